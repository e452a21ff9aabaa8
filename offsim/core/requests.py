"""The requests of an offline job -- one (prompt length, generation length) pair each -- where they come from (a CSV,
or a named distribution of one of four task kinds), and how a policy's block shape cuts them into blocks
(``Workload`` s with per-prompt lengths): padded to each batch's longest prompt in the order they came, as FlexGen
batches them, or length-bucketed (sorted by length first).

The named distributions (``TASKS``) are shaped after public statistics of one dataset per task kind; their sources
and every parameter are in docs/jobs.md §2. A length is drawn from a log-normal with the dataset's mean, clipped
to a range, so a job is reproducible from (task, count, seed).
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from offsim.core.errors import OffsimError
from offsim.core.specs import Workload

BATCHING = ("padded", "bucketed")  # in arrival order, each batch padded to its longest prompt; or sorted first


@dataclass(frozen=True)
class Request:
    """One request of a job: its index in the job (arrival order), its prompt and generation lengths in tokens."""

    index: int
    prompt_len: int
    gen_len: int


# ----------------------------------------------------------------------------------------------------------------
# named length distributions: four task kinds (docs/jobs.md §2 gives each number's source)
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LogNormalLen:
    """A length in tokens: log-normal with mean ``mean_tokens`` and log-space spread ``sigma``, rounded and clipped
    to [``min_tokens``, ``max_tokens``]. ``sigma`` 0 is a constant."""

    mean_tokens: float
    sigma: float
    min_tokens: int
    max_tokens: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        # a log-normal's mean is exp(mu + sigma^2 / 2): mu from the published mean
        mu = math.log(self.mean_tokens) - self.sigma ** 2 / 2
        x = rng.lognormal(mu, self.sigma, n) if self.sigma > 0 else np.full(n, self.mean_tokens)
        return np.clip(np.rint(x), self.min_tokens, self.max_tokens).astype(int)


@dataclass(frozen=True)
class TaskLengths:
    """A task kind: the prompt is a fixed instruction (``template_tokens``) plus a text of length ``text``; the output
    is ``output`` tokens, or, with ``output_per_text_token``, that many tokens per text token (translation: the
    output follows the input) times a log-normal factor of spread ``output_sigma``."""

    name: str
    dataset: str  # the public dataset whose statistics shape it
    template_tokens: int
    text: LogNormalLen
    output: LogNormalLen | None = None
    output_per_text_token: float = 0.0
    output_sigma: float = 0.0
    output_max_tokens: int = 0

    def draw(self, n: int, seed: int) -> list[Request]:
        rng = np.random.default_rng(seed)
        text = self.text.draw(rng, n)
        if self.output is not None:
            out = self.output.draw(rng, n)
        else:
            factor = rng.lognormal(-self.output_sigma ** 2 / 2, self.output_sigma, n) if self.output_sigma else 1.0
            out = np.clip(np.rint(text * self.output_per_text_token * factor), 1, self.output_max_tokens).astype(int)
        return [Request(i, int(self.template_tokens + t), int(g)) for i, (t, g) in enumerate(zip(text, out))]


# Tokens per English word of OPT's / Llama's BPE on news text: ~1.3 (docs/jobs.md §2; an assumption, not measured).
TOKENS_PER_WORD = 1.3
TASKS: dict[str, TaskLengths] = {t.name: t for t in (
    # AG News (Zhang et al. 2015): 120,000 training texts in 29,817,303 bytes = 248 bytes ~ 41 words ~ 54 tokens;
    # the answer is one of four labels, a word or two
    TaskLengths("classification", "AG News", template_tokens=24,
                text=LogNormalLen(54, 0.35, 8, 256), output=LogNormalLen(2, 0.3, 1, 4)),
    # WMT14 newstest2014 En-De: 3,003 sentences, 67,337 English words = 22.4 words ~ 29 tokens a sentence; a
    # request translates a paragraph of 4 sentences (~117 tokens), the output as long again (German ~1.1x in BPE)
    TaskLengths("translation", "WMT14 newstest2014 En-De (4-sentence paragraphs)", template_tokens=16,
                text=LogNormalLen(117, 0.4, 16, 320), output_per_text_token=1.1, output_sigma=0.15,
                output_max_tokens=384),
    # CNN/DailyMail (Nallapati et al. 2016): articles 781 tokens, summaries 56 tokens on average; articles
    # truncated to 1,024 tokens as summarisers (BART) do
    TaskLengths("summarization", "CNN/DailyMail", template_tokens=16,
                text=LogNormalLen(781, 0.5, 64, 1024), output=LogNormalLen(56, 0.35, 8, 128)),
    # the same articles, one forward pass each: the hidden state of the last position is the feature, one token out
    TaskLengths("feature_extraction", "CNN/DailyMail articles (embedding)", template_tokens=0,
                text=LogNormalLen(781, 0.5, 64, 1024), output=LogNormalLen(1, 0.0, 1, 1)),
)}


# the most requests one job draws: their lengths are held in memory, made into blocks, and each distinct block shape
# simulated (docs/jobs.md §4; a million requests are ~16,000 blocks of 64); a larger job is refused from its count,
# before anything is drawn
MAX_REQUESTS = 1_000_000


def _check_count(count) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count <= 0:
        raise OffsimError(f"requests: count must be a positive integer, got {count!r}")
    if count > MAX_REQUESTS:
        raise OffsimError(f"requests: count {count:,} is more than one job takes (at most {MAX_REQUESTS:,}); split "
                          "it into several jobs")


def draw_requests(task: str, count: int, seed: int = 0) -> list[Request]:
    """``count`` requests of a named task kind (``TASKS``), reproducible from ``seed``."""
    if not isinstance(task, str) or task not in TASKS:
        raise OffsimError(f"unknown length distribution {task!r}; valid: {', '.join(TASKS)} (or a CSV of "
                          "prompt_len,gen_len)")
    _check_count(count)
    return TASKS[task].draw(count, seed)


def read_requests_csv(path: str | Path) -> list[Request]:
    """Requests from a CSV with columns ``prompt_len`` and ``gen_len`` (a header line; ``#`` lines skipped), one
    request a row; every problem is an OffsimError naming the file and the line."""
    path = Path(path)
    try:
        # (utf-8-sig: a spreadsheet's "CSV UTF-8" starts with a byte-order mark, which read as part of the header)
        lines = [ln for ln in path.read_text(encoding="utf-8-sig").splitlines()
                 if ln.strip() and not ln.lstrip().startswith("#")]
    except OSError as e:
        raise OffsimError(f"cannot read request lengths {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise OffsimError(f"request lengths {path} is not text (not UTF-8): give a CSV of prompt_len,gen_len") from None
    if len(lines) - 1 > MAX_REQUESTS:  # (before a Request is made of each)
        raise OffsimError(f"request lengths {path}: {len(lines) - 1:,} rows are more than one job takes (at most "
                          f"{MAX_REQUESTS:,}); split it into several jobs")
    rows = list(csv.reader(lines))
    if not rows or [c.strip() for c in rows[0]][:2] != ["prompt_len", "gen_len"]:
        raise OffsimError(f"request lengths {path}: the first line must be the header 'prompt_len,gen_len'")
    out = []
    for n, row in enumerate(rows[1:], start=2):
        try:
            p, g = (int(row[0]), int(row[1]))
        except (ValueError, IndexError):
            raise OffsimError(f"request lengths {path}: row {n} is not two integers: {','.join(row)!r}") from None
        if p <= 0 or g <= 0:
            raise OffsimError(f"request lengths {path}: row {n}: lengths must be positive, got {p}, {g}")
        out.append(Request(len(out), p, g))
    if not out:
        raise OffsimError(f"request lengths {path}: no requests")
    return out


def sample_requests(requests: Sequence[Request], count: int, seed: int = 0) -> list[Request]:
    """``count`` requests drawn from ``requests`` with replacement (an empirical distribution: a CSV), reindexed."""
    _check_count(count)
    rng = np.random.default_rng(seed)
    pick = rng.integers(0, len(requests), count)
    return [Request(i, requests[j].prompt_len, requests[j].gen_len) for i, j in enumerate(pick)]


# ----------------------------------------------------------------------------------------------------------------
# batching
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """One block of a job: its workload (per-prompt lengths in batch order) and the job's request in each slot
    (None: an empty slot)."""

    workload: Workload
    slots: tuple[int | None, ...]


def make_blocks(requests: Sequence[Request], gpu_batch_size: int, num_gpu_batches: int,
                batching: str = "padded") -> list[Block]:
    """Cut the requests into blocks of ``num_gpu_batches`` x ``gpu_batch_size``, run one after another.

    ``padded``: in arrival order; each GPU batch runs padded to its longest prompt and every sequence of a block
    runs the block's longest generation (FlexGen's batching). ``bucketed``: sorted by (prompt, generation) length
    first, so each batch holds similar lengths and pads little. The last block, when partly filled, keeps the GPU
    batch size and has fewer batches (a single batch shrinks to the requests left); the last batch's empty slots
    are padding."""
    if batching not in BATCHING:
        raise OffsimError(f"batching must be one of {BATCHING}, got {batching!r}")
    order = list(requests)
    if batching == "bucketed":
        order.sort(key=lambda r: (r.prompt_len, r.gen_len, r.index))
    per_block = gpu_batch_size * num_gpu_batches
    blocks = []
    for start in range(0, len(order), per_block):
        chunk = order[start:start + per_block]
        gbs, nb = gpu_batch_size, num_gpu_batches
        if len(chunk) < per_block:
            nb = math.ceil(len(chunk) / gbs)
            if nb == 1:
                gbs = len(chunk)
        slots: list[Request | None] = list(chunk) + [None] * (gbs * nb - len(chunk))
        wl = Workload(max(r.prompt_len for r in chunk), max(r.gen_len for r in chunk), gbs, nb,
                      prompt_lens=tuple(r.prompt_len if r else 0 for r in slots),
                      gen_lens=tuple(r.gen_len if r else 0 for r in slots))
        blocks.append(Block(wl, tuple(r.index if r else None for r in slots)))
    return blocks
