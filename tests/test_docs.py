"""The documentation site (docs/, mkdocs.yml) and the README: the site builds in strict mode,
its API reference names every public name, its Performance tables and the README's figures
match the benchmark JSON they come from (scripts/docs_figures.py, also on made-up runs with and
without the torch.distributed rows), and the README stays a short front door.

`mkdocs build --strict` fails on a broken link or anchor, an unresolved cross-reference, a
missing snippet and any warning of mkdocstrings (an object it cannot find or render).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 120        # the build takes about 10 s on a 2-core machine


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def _public_names() -> list[str]:
    """ringreduce.__all__, read from the source (no import of the package)."""
    tree = ast.parse((ROOT / "ringreduce" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("ringreduce/__init__.py has no __all__")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs extra: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out),
             "-f", str(ROOT / "mkdocs.yml")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"mkdocs build took over {BUILD_TIMEOUT_S} s:\n{exc.stdout}\n{exc.stderr}")
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed (exit {result.returncode}):\n"
                    f"{result.stdout}\n{result.stderr}")
    return out


def test_site_builds_strict(site):
    assert (site / "index.html").exists()
    for page in ("getting-started", "performance", "horovod", "architecture", "api/collectives",
                 "api/lightning", "api/distributed", "guide/settings"):
        assert (site / page / "index.html").exists(), page


def test_settings_table_lists_every_setting(site):
    config = _load(ROOT / "ringreduce" / "core" / "config.py", "_ringreduce_config_for_test")
    page = (site / "guide" / "settings" / "index.html").read_text()
    assert "settings-table" not in page, "the settings hook did not run"
    for field in dataclasses.fields(config.Settings):
        assert config.Settings.env_name(field.name) in page, field.name
    assert "RINGREDUCE_ELASTIC_RESET_LIMIT" in page


def test_lightning_classes_documented(site):
    """The strategy's classes are built at import; docs/hooks/griffe_lightning.py inspects them."""
    pytest.importorskip("lightning", reason="the lightning extra")
    page = (site / "api" / "lightning" / "index.html").read_text()
    assert "gradient_as_bucket_view" in page          # RingReduceStrategy's signature
    assert "optimizer_step" in page


def test_api_reference_names_every_public_name():
    """Each name of ringreduce.__all__ has a `::: ringreduce.NAME` block (or, for the ops that
    are ReduceOp members, a row naming `ringreduce.NAME`) on an API page."""
    text = "\n".join(p.read_text() for p in sorted((DOCS / "api").glob("*.md")))
    directives = set(re.findall(r"^::: ringreduce\.([A-Za-z_]\w*)\s*$", text, re.M))
    missing = [n for n in _public_names()
               if n not in directives and f"`ringreduce.{n}`" not in text]
    assert not missing, f"not in docs/api/*.md: {missing}"
    for module in ("elastic", "checkpoint", "lightning", "runner"):
        assert module in directives, f"no `::: ringreduce.{module}` in docs/api/"
    distributed = set(re.findall(r"^::: ringreduce\.distributed\.(\w+)\s*$", text, re.M))
    assert {"init_process_group", "BACKEND"} <= distributed, distributed


def test_performance_tables_match_their_json():
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    assert sorted(DOCS.glob("figures/*.json")), "no benchmark JSON in docs/figures/"
    assert figures.main(["--check"]) == 0, "run: python scripts/docs_figures.py"
    performance = (DOCS / "performance.md").read_text()
    for path in sorted(DOCS.glob("figures/*.json")):
        assert re.search(rf'--8<-- "figures/{re.escape(path.stem)}\.md(:[a-z]+)?"', performance), \
            f"docs/performance.md does not include {path.stem}.md"
    for name in ("allreduce-2ranks", "train-2ranks"):      # the torch.distributed section
        assert f'--8<-- "figures/{name}.md:dist"' in performance, name


def _bench_meta(**extra) -> dict:
    return {"ranks": 2, "hostname": "box", "hosts": ["box"], "cpu_model": "Some CPU 9000",
            "cpu_count": 8, "cpus_usable": 8, "mpi_vendor": "MPICH 5.0.2", "torch": "2.5",
            "torch_num_threads": 1, "python": "3.11.7", "ringreduce": "0.1.0",
            "commit": "0123456789abcdef0123", "dirty": True, "dirty_files": ["ringreduce/x.py"],
            "environment": {"OMP_NUM_THREADS": "1", "RINGREDUCE_BLOCK_BYTES": "2M"},
            "date": "2026-01-02T03:04:05+00:00", "argv": ["scripts/bench.py"], **extra}


def _allreduce_run(methods) -> dict:
    results = []
    for nbytes in (4096, 1 << 20):
        for i, method in enumerate(methods):
            seconds = (1 + i) * nbytes / 1e9
            results.append({"size_bytes": nbytes, "dtype": "float32", "method": method,
                            "time_s": seconds, "busbw_GBps": nbytes / seconds / 1e9,
                            "busbw_over_copy": 0.5, "speedup_vs_mpi": 1.0})
    copies = [{"size_bytes": n, "copy": "memcpy", "where": w, "bw_GBps": 10.0}
              for n in (4096, 1 << 20) for w in ("rank 0", "every rank")]
    return {"meta": _bench_meta(), "copies": copies, "results": results, "profiles": []}


def _train_run(methods, spent: bool = True) -> dict:
    results = [{"model": "mlp", "method": m, "samples_per_s": 100.0 + 10 * i, "step_ms": 50.0,
                "peak_rss_increase_mib_per_rank": [10.0, 12.0], "vs_none": 1.0, "vs_ddp": 1.0}
               for i, m in enumerate(methods)]
    for i, r in enumerate(results if spent else []):     # what bench_train.py records since
        on_ours = r["method"] in ("ringreduce", "ddp_rr", "ddp_rr_view")
        r.update(train_thread_cpu_ms_per_step=40.0 + i, transport_ms_per_step=3.3 if on_ours
                 else None, transport_wait_ms_per_step=0.5 * i if on_ours else None)
    return {"meta": _bench_meta(batch_per_rank=32),
            "models": [{"model": "mlp", "params": 23_500_000, "grad_mib": 89.6}],
            "results": results}


def test_figures_show_the_run_and_the_torch_distributed_rows(tmp_path):
    """A run with the new metadata and the backend's rows: the Run line names the commit, the
    machine and the environment; the `dist` sections show dist_rr and ddp_rr (and DDP with
    bucket views) beside gloo."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    (tmp_path / "allreduce-2ranks.json").write_text(json.dumps(
        _allreduce_run(["ours_", "ours", "bucket", "dist_rr", "dist_sync", "mpi", "gloo"])))
    (tmp_path / "train-2ranks.json").write_text(json.dumps(
        _train_run(["none", "ringreduce", "ddp_rr_view", "ddp_rr", "ddp"])))
    readme = tmp_path / "README.md"
    readme.write_text("# x\n<!-- figures:start -->\n<!-- figures:end -->\nafter\n")
    assert figures.main(["--dir", str(tmp_path), "--readme", str(readme)]) == 0
    assert figures.main(["--dir", str(tmp_path), "--readme", str(readme), "--check"]) == 0
    allreduce = (tmp_path / "allreduce-2ranks.md").read_text()
    train = (tmp_path / "train-2ranks.md").read_text()
    for text in (allreduce, train):
        assert "commit `0123456789ab` with uncommitted changes to `ringreduce/x.py`" in text
        assert "`box` (8 CPUs, Some CPU 9000)" in text
        assert "`OMP_NUM_THREADS=1` `RINGREDUCE_BLOCK_BYTES=2M`" in text
        assert "[start:tables]" in text and "[start:dist]" in text
    dist = allreduce.split("[start:dist]")[1]
    assert "`\"ringreduce\"` backend (`dist_rr`)" in dist and "× faster than gloo" in dist
    assert "synchronous: `dist.all_reduce(t)` (`dist_sync`)" in dist
    dist = train.split("[start:dist]")[1]
    assert "DDP on `\"ringreduce\"`" in dist and "DDP on gloo" in dist
    assert "| MLP 23.5M (`mlp`) | 110 | 130 | 140 | 0.93 × | 1.18 × | 120 | 1.09 × |" in dist
    assert "where a step's time goes" in dist
    assert "| MLP 23.5M (`mlp`): DDP on `\"ringreduce\"` | 50.0 | 43.0 | 3.3 | 1.5 |" in dist
    assert "| MLP 23.5M (`mlp`): DDP on gloo | 50.0 | 44.0 | n/a | n/a |" in dist
    before = _train_run(["none", "ringreduce", "ddp_rr", "ddp"], spent=False)    # older files
    assert "where a step's time goes" not in figures.train_dist(before, "train-2ranks.json")
    assert "1.18 × `DistributedOptimizer` (1.09 × with DDP's `gradient_as_bucket_view=True`)" \
        in readme.read_text()
    head = readme.read_text()
    assert head.startswith("# x\n<!-- figures:start -->")
    assert head.endswith("<!-- figures:end -->\nafter\n")
    assert "DDP on the `\"ringreduce\"` backend" in head and "1 MiB float32 in place" in head


def test_figures_name_uncommitted_code_not_a_figure_written_before():
    """A run made while an earlier run's figure was not committed yet ran the committed code:
    its Run line names the commit alone; a changed source file is named."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    meta = {"commit": "0123456789abcdef", "dirty": True, "dirty_count": 2,
            "dirty_files": ["docs/figures/allreduce-2ranks.json", "README.md"]}
    assert figures.commit(meta) == "commit `0123456789ab`"
    meta["dirty_files"].append("ringreduce/x.py")
    meta["dirty_count"] = 3
    assert figures.commit(meta, name_files=1) == ("commit `0123456789ab` with uncommitted "
                                                  "changes to `docs/figures/allreduce-2ranks."
                                                  "json` and 2 more files")
    meta["dirty_count"] = 25        # more than the file names recorded: not known to be docs
    meta["dirty_files"] = meta["dirty_files"][:2]
    assert "with uncommitted changes" in figures.commit(meta)


def test_figures_without_the_new_rows_say_so(tmp_path):
    """Files from before the backend's rows (and before the richer metadata) still render: the
    dist sections say how to fill them, and the Run line what it does not know."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    old = {"ranks": 2, "hostname": "vm", "hosts": ["vm"], "cpu_count": 2,
           "mpi_library": "MPICH Version: 5.0.2\nmore"}
    run = _allreduce_run(["ours_", "mpi", "gloo"])
    run["meta"] = old
    (tmp_path / "allreduce-2ranks.json").write_text(json.dumps(run))
    run = _train_run(["none", "ringreduce", "ddp"], spent=False)
    run["meta"] = dict(old, batch_per_rank=32)
    (tmp_path / "train-2ranks.json").write_text(json.dumps(run))
    assert figures.main(["--dir", str(tmp_path)]) == 0
    for name, row in (("allreduce-2ranks", "dist_rr"), ("train-2ranks", "ddp_rr")):
        text = (tmp_path / f"{name}.md").read_text()
        assert "commit not recorded" in text and "environment not recorded" in text
        assert f"This run has no `{row}` rows" in text.split("[start:dist]")[1]


def test_readme_is_the_front_door():
    """Short; the two commands exactly as .ci/run runs the tests; the docs command; links that
    lead somewhere; the figures block generated (test_performance_tables_match_their_json)."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 200
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if "pytest" in line)
    assert test_command.strip() in readme
    assert ('python3 -m venv .venv && .venv/bin/pip install -e ".[mpich,test]" && '
            '.venv/bin/mpiexec -n 2 .venv/bin/python scripts/train_digits.py') in readme
    assert '.venv/bin/python -m mkdocs serve' in readme
    assert "<!-- figures:start -->" in readme and "<!-- figures:end -->" in readme
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", readme):
        assert (ROOT / target).exists(), f"README links to a missing file: {target}"


def test_a_gpu_check_run_renders_against_the_gpus_own_copy(tmp_path):
    """scripts/gpu_check.py --json (made up here: no GPU on this machine): a table per size
    and path, each busbw with its ratio to the device-to-device copy, and the Run line."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    run = {"meta": {"ranks": 2, "hostname": "gpu", "hosts": ["gpu"], "gpu": "NVIDIA H200",
                    "cuda_aware": "False (MPIX_Query_cuda_support())", "environment": {},
                    "date": "2026-12-04T12:20:00+00:00"},
           "sizes_mib": [1, 256], "busbw_GBps": {"staging": [1.59, 4.46]},
           "device_copy_GBps": 2083.6}
    (tmp_path / "gpu-2ranks.json").write_text(json.dumps(run))
    assert figures.main(["--dir", str(tmp_path)]) == 0
    text = (tmp_path / "gpu-2ranks.md").read_text()
    assert "| 256 MiB | 4.46 GB/s (0.0021 × copy) |" in text, text
    assert "2,084 GB/s" in text and "NVIDIA H200" in text and "2 ranks on one GPU" in text
    assert text.count("Run: 2026-12-04 12:20:00+00:00, on `gpu`") == 1


def test_a_gpu_check_run_puts_staging_against_the_slower_of_its_yardsticks(tmp_path):
    """A file with the staging path's yardsticks (host allreduce, pinned copies down and
    up): each staging busbw against the slower of the two at its size, and both as columns."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    run = {"meta": {"ranks": 2, "gpu": "NVIDIA H200"}, "sizes_mib": [1, 64],
           "busbw_GBps": {"staging": [1.4, 4.8]},
           "staging_yardsticks_GBps": {"host allreduce": [3.5, 6.0], "pinned down+up": [14.0, 3.2]},
           "device_copy_GBps": 2090.7}
    (tmp_path / "gpu-2ranks.json").write_text(json.dumps(run))
    assert figures.main(["--dir", str(tmp_path)]) == 0
    text = (tmp_path / "gpu-2ranks.md").read_text()
    assert "| size | staging busbw | host allreduce | pinned down+up |" in text, text
    assert "| 1 MiB | 1.40 GB/s (0.4 × yardstick) | 3.50 GB/s | 14.0 GB/s |" in text, text
    assert "| 64 MiB | 4.80 GB/s (1.5 × yardstick) | 6.00 GB/s | 3.20 GB/s |" in text, text
    assert "slower of two" in text


def test_a_gpu_node_run_puts_each_way_against_the_copy_of_its_size(tmp_path):
    """scripts/gpu_node_bench.py --json (made up: no GPU here): each way's busbw with its
    ratio to the device copy of the same size, the 4 KiB latencies, samples/s against no
    communication."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    run = {"meta": {"ranks": 2, "gpu": "NVIDIA H100"}, "sizes_mib": [1, 64],
           "busbw_GBps": {"ipc float32": [50.0, 600.0], "staging float32": [1.5, 4.9]},
           "device_copy_GBps": [500.0, 1500.0], "device_copy_every_rank_GBps": [300.0, 750.0],
           "latency_4KiB_us": {"ipc": 80.0, "staging": 400.0},
           "training_samples_per_s": {"no communication": 20000.0,
                                      "DistributedOptimizer, ipc": 15000.0}}
    (tmp_path / "gpu-node-2ranks.json").write_text(json.dumps(run))
    assert figures.main(["--dir", str(tmp_path)]) == 0
    text = (tmp_path / "gpu-node-2ranks.md").read_text()
    assert ("| 64 MiB | 600 GB/s (0.4 × copy) | 4.90 GB/s (0.0033 × copy) | 1,500 GB/s "
            "| 750 GB/s |") in text, text
    assert "ipc 80.0 µs, staging 400 µs" in text, text
    assert "| DistributedOptimizer, ipc | 15,000 | 0.75 |" in text, text


def test_the_gpu_cost_model_renders_time_busbw_and_where_it_goes(tmp_path):
    """cost_model.py --gpu --json: time (and busbw from 1 MiB) per way, NCCL's time over ours,
    and the share of each term of our time."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    model = _load(ROOT / "scripts" / "cost_model.py", "cost_model")
    out = tmp_path / "cost-model-gpu.json"
    model.main(["--gpu", "--json", str(out)])
    assert figures.main(["--dir", str(tmp_path)]) == 0
    text = (tmp_path / "cost-model-gpu.md").read_text()
    data = json.loads(out.read_text())
    row = next(r for r in data["rows"] if r["nodes"] == 16 and r["size_bytes"] == 64 << 20)
    assert f"{row['NCCL ring'] / row['ours, CUDA-aware']:.2f} |" in text
    assert "| 64 MiB | 16 |" in text and "GB/s" in text
    assert "- 64 MiB on 16 node(s): per call" in text, text


def test_a_p2p_run_puts_send_and_recv_beside_mpi_and_gloo(tmp_path):
    """bench_p2p.py's file: one row per method, sizes as columns, our row with its ratios to
    MPI's Send/Recv and gloo's; a run without gloo has no gloo row or ratio."""
    figures = _load(ROOT / "scripts" / "docs_figures.py", "_docs_figures_for_test")
    rows = [{"size_bytes": 4096, "method": "dist_rr", "time_s": 20e-6, "GBps": 0.2048,
             "speedup_vs_mpi": 0.15, "speedup_vs_gloo": 7.5},
            {"size_bytes": 4096, "method": "mpi", "time_s": 3e-6, "GBps": 1.366},
            {"size_bytes": 4096, "method": "gloo", "time_s": 150e-6, "GBps": 0.0273}]
    path = tmp_path / "p2p-2ranks.json"
    path.write_text(json.dumps({"meta": {"ranks": 2}, "p2p": rows}))
    text = figures.render(path)
    assert "| send/recv, one way, 2 ranks | 4 KiB |" in text, text
    assert ("| `dist.send` / `dist.recv` on `\"ringreduce\"` | 20.0 µs (0.205 GB/s); 0.15 × MPI, "
            "7.5 × gloo |") in text, text
    assert "| MPI's `Send` / `Recv` | 3.00 µs (1.37 GB/s) |" in text, text
    assert "Yardstick: MPI's own `Send`/`Recv`" in text
    rows[0]["speedup_vs_gloo"] = None
    path.write_text(json.dumps({"meta": {"ranks": 2}, "p2p": rows[:2]}))
    text = figures.render(path)
    assert "0.15 × MPI |" in text and "on gloo" not in text, text
