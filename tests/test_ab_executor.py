"""experiments.validation.ab_executor: the table of two executors' runs of one stored plan, beside offsim's price."""
import gzip
import json
import shutil

from experiments.validation.ab_executor import PROFILES, write
from offsim.core.sim import simulate
from offsim.core.specs import Workload, get_hardware, get_model
from offsim.policies import build_plan, get_policy


def test_ab_table_prices_the_stored_plan_and_compares_sides(tmp_path):
    """A 'new' run that is offsim's own simulation on profile v2 is priced at exactly its own CPU-attention time
    (ratio 1.00, error 0); an 'old' run 10 % slower in every op shows as new / old decode 1.1."""
    model, hw = get_model("opt-125m"), get_hardware(str(PROFILES["v2"]), gpu_mem_gb=4)
    pol = get_policy("flexgen")
    settings = pol.settings_from(pol.inputs_of({"percent": [100, 0, 0, 100, 100, 0], "cpu_attention": True}))
    plan = build_plan("flexgen", model, hw, Workload(prompt_len=32, gen_len=8, gpu_batch_size=4, num_gpu_batches=2),
                      settings)
    plan.save(tmp_path / "p.plan.json.gz")
    trace = simulate(plan, hw, check_memory=False)
    trace.meta.update(cuda_graphs=plan.cuda_graphs, graph_max_q_tokens=plan.graph_max_q_tokens)  # as offexec's
    assert (trace.df["kind"] == "cpu_compute").any()
    slow = trace.df.copy()
    slow[["start_s", "end_s"]] *= 1.1
    for name, t in (("p_new_1", trace), ("p_old_1", type(trace)(df=slow, meta=trace.meta, peak_bytes=trace.peak_bytes))):
        t.to_csv(tmp_path / f"{name}.csv")  # as offexec run --trace writes it, gzipped as the folder keeps it
        with open(tmp_path / f"{name}.csv", "rb") as src, gzip.open(tmp_path / f"{name}.csv.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
    (tmp_path / "probes.jsonl").write_text(json.dumps({"at": "p_new_1", "cpu_attn_ms": 2.5}) + "\n")

    text = write(tmp_path, same_day=None).read_text()
    assert "| p | new | 1 | 2.50 |" in text
    new_row = next(line for line in text.splitlines() if line.startswith("| p | new | 1 |"))
    assert new_row.rstrip(" |").endswith("1.00")  # in run / v2
    by_side = text.split("## By plan and side")[1]
    new_side = next(line for line in by_side.splitlines() if line.startswith("| p | new |"))
    assert new_side.endswith("+0.0% |")  # offsim v2 total against its own simulation
    assert "p 1.100" in text  # new / old decode tok/s
    assert (tmp_path / "ab.csv").exists()
