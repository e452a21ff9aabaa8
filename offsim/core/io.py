"""File helpers shared by plans, profiles, traces, cases and records: atomic writes (nothing is ever left
half-written) and reads whose errors name the file and say what is wrong.

A "commented CSV" is a CSV whose first line is '# ' + a JSON object (schema, provenance, metadata); pandas reads
the rest with ``comment='#'`` too.
"""
from __future__ import annotations

import collections.abc
import contextlib
import functools
import gzip
import json
import math
from pathlib import Path
from typing import Any, Iterator

import pandas as pd

from offsim.core.errors import OffsimError


@contextlib.contextmanager
def open_atomic(path: str | Path, binary: bool = False) -> Iterator:
    """A text file (``binary``: a bytes file) to write ``path`` through: a temporary file beside it, renamed over it
    once the ``with`` body is done, so a failure leaves the old file (or none) and never half of a new one; gzipped
    when the name ends in .gz.
    A symbolic link is written through (its target replaced, the link kept); a path that exists and is not a
    regular file (``/dev/stdout``, a pipe) is written straight into, since it cannot be replaced. A write that
    fails (no such directory, no permission, disk full) is an ``OffsimError`` naming the path."""
    path = Path(path)
    tmp = None
    try:
        if path.exists() and not path.is_file():  # (``exists`` and ``is_file`` follow links: /dev/stdout is one)
            with open(path, "wb" if binary else "w") as f:
                yield f
            return
        target = path.resolve() if path.is_symlink() else path
        tmp = target.with_name(target.name + ".tmp")
        b = "b" if binary else "t"
        with (gzip.open(tmp, "w" + b) if target.suffix == ".gz" else open(tmp, "w" + b)) as f:
            yield f
        tmp.replace(target)
    except OSError as e:
        _remove(tmp)
        raise OffsimError(f"cannot write {path}: {getattr(e, 'strerror', None) or e}") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path | None) -> None:
    """A failed write's temporary file, if it was made (its directory may not even exist)."""
    if tmp is not None:
        with contextlib.suppress(OSError):
            tmp.unlink()


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (``open_atomic``: gzipped when the name ends in .gz)."""
    with open_atomic(path) as f:
        f.write(text)


def finite_json(obj):
    """``obj`` with every float that is not finite (a decode rate with no decode step: gen-len 1) as None: strict
    JSON has no Infinity or NaN, and a reader that parses it strictly would fail on the whole line."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _unique_keys(pairs: list) -> dict:
    """A JSON object's pairs as a dict, refusing a key given twice (``json`` keeps the last in silence)."""
    d = {}
    for k, v in pairs:
        if k in d:
            raise DuplicateKey(k)
        d[k] = v
    return d


class DuplicateKey(ValueError):
    pass


def read_json_object(path: str | Path, what: str, error: type[OffsimError] = OffsimError,
                     unique_keys: bool = False) -> dict:
    """The JSON object in ``path``; ``what`` names it in errors ('plan', 'hardware profile', ...). ``unique_keys``:
    a key given twice in an object is an error (a spec a person wrote: the first of the two would be dropped)."""
    try:
        path = Path(path)
        text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
        d = json.loads(text, object_pairs_hook=_unique_keys if unique_keys else None)
    except DuplicateKey as e:
        raise error(f"{what} {path}: key {e.args[0]!r} is given twice in one object (JSON would keep the last in "
                    "silence): keep one") from None
    except (OSError, EOFError) as e:
        raise error(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    except UnicodeDecodeError:
        raise error(f"{what} {path} is not text (not UTF-8): give a JSON file") from None
    except json.JSONDecodeError as e:
        raise error(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise error(f"{what} {path}: expected a JSON object")
    return d


def write_commented_csv(path: str | Path, header: dict, df: pd.DataFrame) -> None:
    """CSV with '# ' + ``header`` as JSON on its first line, written atomically (gzipped when the name ends in
    .gz)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OffsimError(f"cannot write {path}: {e.strerror or e}") from None
    with open_atomic(path) as f:
        f.write("# " + json.dumps(header, default=str) + "\n")
        df.to_csv(f, index=False)


def read_commented_csv(path: str | Path, what: str, **read_csv) -> tuple[dict, pd.DataFrame]:
    """(header, rows) of a commented CSV; errors name the file. ``read_csv``: options for ``pd.read_csv`` (e.g.
    ``dtype``)."""
    path = Path(path)
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            head = f.readline()
            if not head.startswith("# "):
                raise OffsimError(f"{what} {path}: first line must be '# ' + JSON metadata")
            header = json.loads(head[2:])
            df = pd.read_csv(f, **read_csv)
    except json.JSONDecodeError as e:
        raise OffsimError(f"{what} {path}: metadata line is not JSON ({e})") from None
    except (OSError, EOFError) as e:  # (a .gz that is not gzip, or is cut short: strerror is None)
        raise OffsimError(f"cannot read {what} {path}: {getattr(e, 'strerror', None) or e}") from None
    except UnicodeDecodeError:
        raise OffsimError(f"{what} {path} is not text (not UTF-8)") from None
    except pd.errors.EmptyDataError:
        raise OffsimError(f"{what} {path} has its metadata line but no table (no header row)") from None
    except pd.errors.ParserError as e:
        raise OffsimError(f"{what} {path}: the table is malformed ({' '.join(str(e).split())})") from None
    if not isinstance(header, dict):
        raise OffsimError(f"{what} {path}: metadata line must be a JSON object")
    return header, df


def read_spec(path: str | Path, what: str) -> Any:
    """A spec file: YAML for ``.yaml``/``.yml``, else a JSON object; errors name the file (``offsim sweep``,
    ``offsim job``)."""
    path = Path(path)
    if path.suffix not in (".yaml", ".yml"):
        return read_json_object(path, what, unique_keys=True)
    import yaml

    try:
        return yaml.load(path.read_text(), Loader=_yaml_loader())
    except OSError as e:
        raise OffsimError(f"cannot read {what} {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise OffsimError(f"{what} {path} is not text (not UTF-8): give a YAML or JSON file") from None
    except yaml.YAMLError as e:
        raise OffsimError(f"{what} {path} is not valid YAML: {' '.join(str(e).split())}") from None


_YAML12_INT = r"^(?:[-+]?[0-9][0-9_]*|[-+]?0[xX][0-9a-fA-F_]+|[-+]?0[oO][0-7_]+)$"
_YAML12_FLOAT = r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
|[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
|[-+]?\.(?:inf|Inf|INF)
|\.(?:nan|NaN|NAN))$"""


@functools.lru_cache(maxsize=None)
def _yaml_loader():
    """PyYAML's safe loader with YAML 1.2's numbers and unique keys: YAML 1.1 (PyYAML's) reads ``1e3`` and
    ``1.6e1`` as text (it wants a dot and a signed exponent, ``1.0e+3``), so a spec's ``count: 1e3`` was refused as
    "got '1e3'"; it reads ``010`` as eight and ``1:30`` as ninety; and of a key given twice it keeps the last."""
    import re

    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            """A key given twice in one mapping is an error (YAML 1.2 forbids it; PyYAML keeps the last)."""
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if not isinstance(key, collections.abc.Hashable):
                    continue  # (refused by the mapping itself, with PyYAML's message)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

        def construct_yaml_int(self, node):
            """YAML 1.2's integers: 010 is ten (not eight), 0o10 eight, 0x10 sixteen."""
            text = self.construct_scalar(node).replace("_", "")
            sign, digits = (-1, text[1:]) if text[0] == "-" else (1, text.lstrip("+"))
            base = 16 if digits[:2].lower() == "0x" else 8 if digits[:2].lower() == "0o" else 10
            return sign * int(digits[2:] if base != 10 else digits, base)

    tags = {"tag:yaml.org,2002:float", "tag:yaml.org,2002:int"}
    # new lists (``add_implicit_resolver`` appends to the inherited ones, which would change every SafeLoader)
    Loader.yaml_implicit_resolvers = {ch: [r for r in rs if r[0] not in tags]
                                      for ch, rs in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(_YAML12_INT), list("-+0123456789"))
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(_YAML12_FLOAT, re.X), list("-+0123456789."))
    Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)
    return Loader
