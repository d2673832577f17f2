"""Benchmark of a GRPO step: shardtune's ``grpo_distributed`` against TRL's ``GRPOTrainer`` on the same work.

    python -m benchmarks.grpo --shapes tiny,half --steps 4 --repeats 2 --stacks shardtune,trl,trl_fsdp2  # idle
    python -m benchmarks.grpo --smoke                                      # tiny, 3 steps, no BENCHMARKS.md

Both stacks get the same model files (an HF directory with the byte tokenizer), the same prompts
(the digit-sum asset through the ``simple`` template), the same rewards (``digit_sum`` + 0.5
``answer_format``), ``num_generations``, ``max_completion_tokens``, sampling (temperature 1, top-p 1),
LoRA (rank 8 on every projection), the DAPO loss with beta 0, fp32, and one optimizer step per
generation batch of ``world · batch`` prompts:

* ``shardtune``: ``shardtune run --nproc_per_node W grpo_distributed --config tiny/grpo`` (FSDP2
  over W CPU ranks, one thread each, shardtune's batched KV-cache generation); per step from its
  ``metrics.jsonl``: ``gen_tokens_per_second`` (per rank) and the step time (the step's completion
  tokens over ``tokens_per_second``).
* ``trl``: ``GRPOTrainer`` in one process with W threads (``--trl-threads``),
  ``per_device_train_batch_size`` = the whole generation batch, ``model.generate`` (transformers);
  its generate calls timed and their completion tokens counted (up to and with EOS), its steps
  timed by a callback. Run it idle: on a loaded 2-core machine its 2 OpenMP threads collapse
  (tiny: 36 tokens/s with 2 threads, 953 with 1, in the same minute), so compare ``--trl-threads 1`` too.
* ``trl_fsdp2``: the same under ``accelerate launch --use_fsdp --fsdp_version 2 --cpu`` on W
  processes, one thread each (``--stacks shardtune,trl,trl_fsdp2``; when it does not run, the table says why).

A second table compares the generation engines alone (``--decode-tokens``, 0 skips it): in one
process of one thread, the same model files and ``--decode-rows`` left-padded prompts of unequal
lengths sampled for exactly that many new tokens (no stop token) by shardtune's ``generate_batch``
(one generator per row, as a rollout draws) and by transformers' ``generate``; prefill included,
no FSDP, no collective. It separates what the engines cost from what the step adds around them
(FSDP2's all-gathers over gloo, several ranks sharing one machine's memory bandwidth).

The first step of every run is warm-up, not counted; a value is the median over the other steps
of every repeat. Results print as a Markdown table and, unless ``--no-markdown``/``--smoke``,
replace the ``grpo`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks._driver import REPO_ROOT, environment_lines, finish, rotated
from benchmarks._hf_models import HALF_B, llama_dir

MARKERS = ("<!-- grpo:begin -->", "<!-- grpo:end -->")
SHAPES = ("tiny", "half")
METHODS = ("shardtune", "trl", "trl_fsdp2")
DECODE_ENGINES = ("shardtune", "transformers")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = "Q: {instruction}\nA: "  # the ``simple`` template tiny/grpo renders the asset with


def model_dir(bench_dir: Path, shape: str) -> Path:
    """The HF directory (weights, byte tokenizer) both stacks load, written once."""
    from shardtune.data import save_byte_tokenizer

    if shape == "tiny":
        from shardtune.checkpoint.formats.tiny_base import create_tiny_base

        path = bench_dir / "grpo_tiny"
        if not (path / "config.json").is_file():
            create_tiny_base(path)
        return path
    path = llama_dir(bench_dir, HALF_B)
    if not (path / "tokenizer.json").is_file():
        save_byte_tokenizer(path)
    return path


def _subprocess_env(**extra: str) -> dict[str, str]:
    """This environment with the repository first on ``PYTHONPATH`` (and ``extra``), for a benchmark child."""
    path = f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return {**os.environ, "PYTHONPATH": path, **extra}


def _last_line(proc: subprocess.CompletedProcess) -> str:
    """A failed child's last output line (its error), for the table's note."""
    return (proc.stdout + proc.stderr).strip().splitlines()[-1][:300] if proc.stderr else "failed"


# --------------------------------------------------------------------------- shardtune


def run_shardtune(work: dict[str, Any], out: Path) -> dict[str, Any]:
    """The recipe on ``work["world"]`` ranks; per-step generation tokens/s (per rank) and step seconds."""
    shutil.rmtree(out, ignore_errors=True)
    rows = work["world"] * work["batch"] * work["generations"]
    cmd = [
        sys.executable, "-m", "shardtune.cli", "run", "--nproc_per_node", str(work["world"]), "grpo_distributed",
        "--config", "tiny/grpo", f"output_dir={out}", f"checkpoint_dir={work['model']}", "tokenizer=null",
        f"max_steps_per_epoch={work['steps']}", f"batch_size={work['batch']}", "save_every_n_steps=null",
        f"grpo.num_generations={work['generations']}", f"grpo.max_completion_tokens={work['completion']}",
        f"max_seq_len={work['completion'] + 64}", f"optimizer.lr={work['lr']}", f"seed={work['seed']}",
        "grpo.epsilon_high=0.28", "grpo.beta=0.0", "grpo.loss_type=dapo", "shuffle=false",
    ]  # fmt: skip
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=work["timeout"], env=_subprocess_env(), cwd=REPO_ROOT
    )
    if proc.returncode != 0:
        return {"error": _last_line(proc)}
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "gen_tokens_per_s": [m["gen_tokens_per_second"] for m in metrics],
        "step_s": [m["completion_length"] * rows / m["tokens_per_second"] for m in metrics],
        "completion_length": [m["completion_length"] for m in metrics],
    }


# --------------------------------------------------------------------------- TRL


def trl_worker(work: dict[str, Any], out: Path) -> None:
    """In this process (or every ``accelerate launch`` process): TRL's GRPOTrainer on the work;
    rank 0 writes per-step generation seconds and tokens, and step seconds, to ``out``."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from torch.distributed.tensor import DTensor

    from shardtune.data.sources import asset_path, load_records
    from shardtune.rl import toy_rewards

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.set_num_threads(work["trl_threads"] if world == 1 else 1)  # the same cores: W processes of 1 thread
    records = load_records(str(asset_path("tiny_digit_sum.jsonl")))
    dataset = Dataset.from_list([{"prompt": PROMPT.format_map(r), "answer": r["answer"]} for r in records])
    tokenizer = transformers.AutoTokenizer.from_pretrained(work["model"])
    args = trl.GRPOConfig(
        output_dir=str(out.parent / "trl_out"), per_device_train_batch_size=work["batch"] * work["generations"] * work["world"] // world,
        num_generations=work["generations"], max_completion_length=work["completion"], temperature=1.0, top_p=1.0,
        loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, learning_rate=work["lr"], lr_scheduler_type="constant",
        weight_decay=0.0, max_steps=work["steps"], use_cpu=True, bf16=False, report_to="none", logging_steps=1,
        save_strategy="no", seed=work["seed"], reward_weights=[1.0, 0.5], max_grad_norm=1.0, shuffle_dataset=False,
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    trainer = trl.GRPOTrainer(
        model=work["model"], reward_funcs=[toy_rewards.digit_sum, toy_rewards.answer_format], args=args,
        train_dataset=dataset, processing_class=tokenizer,
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS),
    )  # fmt: skip
    gen: list[tuple[float, int]] = []
    steps: list[float] = []
    eos = tokenizer.eos_token_id
    generating = trainer.model
    original = generating.generate

    def timed_generate(*a: Any, **kw: Any) -> Any:
        started = time.perf_counter()
        ids = original(*a, **kw)
        seconds = time.perf_counter() - started
        prompt = (kw.get("input_ids") if "input_ids" in kw else a[0]).shape[1]
        completion = ids[:, prompt:]
        ended = (completion == eos).int().cumsum(1)
        tokens = int(((ended == 0) | ((ended == 1) & (completion == eos))).sum())  # up to and with EOS
        gen.append((seconds, tokens))
        return ids

    generating.generate = timed_generate

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.started = time.perf_counter()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            steps.append(time.perf_counter() - self.started)

    trainer.add_callback(StepTimer())
    trainer.train()
    sharded = sum(isinstance(p, DTensor) for p in trainer.model.parameters())
    how = f"{trainer.accelerator.distributed_type}, {sharded} DTensor parameters, {torch.get_num_threads()} threads"
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps({"gen": gen, "steps": steps, "processes": world, "how": how}))


def run_trl(work: dict[str, Any], out: Path, *, fsdp: bool) -> dict[str, Any]:
    """``trl_worker`` in a fresh process (``fsdp``: W processes under accelerate's FSDP2)."""
    spec = out.with_suffix(".work.json")
    spec.write_text(json.dumps(work))
    out.unlink(missing_ok=True)
    worker = ["-m", "benchmarks.grpo", "--trl-worker", str(spec), "--trl-out", str(out)]
    if fsdp:
        launch = [
            "--num_processes", str(work["world"]), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", "--use_fsdp", "--fsdp_version", "2",
            "--fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP", "--fsdp_transformer_layer_cls_to_wrap",
            "LlamaDecoderLayer", "--fsdp_state_dict_type", "SHARDED_STATE_DICT",
        ]  # fmt: skip
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, *worker]  # accelerate launch
    else:
        cmd = [sys.executable, *worker]
    env = _subprocess_env(OMP_NUM_THREADS="1" if fsdp else str(work["trl_threads"]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=work["timeout"], env=env, cwd=REPO_ROOT)
    if proc.returncode != 0 or not out.is_file():
        tail = [line for line in (proc.stdout + proc.stderr).strip().splitlines() if "Error" in line or "error" in line]
        return {"error": (tail[-1] if tail else f"exit {proc.returncode}")[:300]}
    got = json.loads(out.read_text())
    per_process = max(1, got["processes"])
    return {
        # per rank: one process's tokens over its seconds (a single process is the whole batch)
        "gen_tokens_per_s": [tokens / max(seconds, 1e-9) for seconds, tokens in got["gen"]],
        "step_s": got["steps"],
        "processes": per_process,
        "how": got["how"],
    }


# --------------------------------------------------------------------------- decode alone


def decode_prompts(rows: int) -> list[list[int]]:
    """``rows`` prompts of unequal lengths (20, 23, 26, ... byte-tokenizer ids), left-padded by both engines."""
    return [[40 + (7 * i + j) % 50 for j in range(20 + 3 * i)] for i in range(rows)]


def measure_decode(model_path: str, *, rows: int, tokens: int, engine: str) -> float:
    """Completion tokens per second of one engine in this process (one thread): ``rows`` prompts,
    exactly ``tokens`` new tokens each, sampled at temperature 1."""
    import torch

    torch.set_num_threads(1)
    prompts = decode_prompts(rows)
    longest = max(map(len, prompts))
    if engine == "shardtune":
        from shardtune.inference.generation import generate_batch, load_generator

        model = load_generator(model_path).model
        generators = [torch.Generator().manual_seed(i) for i in range(rows)]
        started = time.perf_counter()
        out = generate_batch(model, prompts, max_new_tokens=tokens, device="cpu", generator=generators, pad_id=0)
        seconds = time.perf_counter() - started
        made = sum(map(len, out))
    else:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
        pads = torch.tensor([longest - len(p) for p in prompts])
        attention = (torch.arange(longest)[None] >= pads[:, None]).long()
        torch.manual_seed(0)
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids, attention_mask=attention, max_new_tokens=tokens, min_new_tokens=tokens,
                do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        seconds = time.perf_counter() - started
        made = (out.shape[1] - longest) * rows
    if made != rows * tokens:
        raise RuntimeError(f"{engine} made {made} tokens, not {rows} x {tokens}")
    return made / seconds


def run_decode(model_path: str, *, rows: int, tokens: int, engine: str, timeout: float) -> dict[str, Any]:
    """:func:`measure_decode` in a fresh process (one thread), so each engine starts from the same state."""
    cmd = [sys.executable, "-m", "benchmarks.grpo", "--decode-worker", json.dumps([model_path, rows, tokens, engine])]
    env = _subprocess_env(OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    if proc.returncode != 0:
        return {"error": _last_line(proc)}
    return {"tokens_per_s": float(proc.stdout.strip().splitlines()[-1])}


def decode_report(decode: dict[tuple[str, str], list[dict[str, Any]]], *, rows: int, tokens: int) -> list[str]:
    """The engines table: per shape, median tokens/s of each engine and its ratio to transformers'."""
    lengths = [len(p) for p in decode_prompts(rows)]
    lines = [
        f"Generation engines alone (one process, one thread; {rows} left-padded prompts of {min(lengths)}-{max(lengths)} "
        f"tokens, exactly {tokens} sampled tokens each, prefill included; median over repeats):",
        "",
        "| shape | engine | tokens/s | vs transformers |",
        "| --- | --- | ---: | ---: |",
    ]
    for shape in dict.fromkeys(s for s, _ in decode):
        medians = {}
        for engine in DECODE_ENGINES:
            values = [r["tokens_per_s"] for r in decode.get((shape, engine), []) if "tokens_per_s" in r]
            medians[engine] = statistics.median(values) if values else None
        for engine in DECODE_ENGINES:
            value, peer = medians[engine], medians["transformers"]
            if value is None:
                error = next((r["error"] for r in decode.get((shape, engine), []) if "error" in r), "not run")
                lines.append(f"| {shape} | {engine} | failed: `{error}` | |")
                continue
            ratio = f"{value / peer:.2f}x" if peer else ""
            lines.append(f"| {shape} | {engine} | {value:.1f} | {ratio} |")
    return lines


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpo", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="tiny,half", help="comma list of tiny, half (Qwen2.5-0.5B-shaped)")
    p.add_argument("--world", type=int, default=2, help="ranks (shardtune, trl_fsdp2); TRL's threads")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is warm-up")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--batch", type=int, default=2, help="prompts per rank per step (tiny); half: --half-batch")
    p.add_argument("--half-batch", type=int, default=1)
    p.add_argument("--generations", type=int, default=4)
    p.add_argument("--completion", type=int, default=32, help="max_completion_tokens (tiny)")
    p.add_argument("--half-completion", type=int, default=128, help="max_completion_tokens (half)")
    p.add_argument("--trl-threads", type=int, default=None, help="threads of the one TRL process (default: --world)")
    p.add_argument("--stacks", default="shardtune,trl", help="comma list of shardtune, trl, trl_fsdp2")
    p.add_argument("--smoke", action="store_true", help="tiny only, 3 steps, no BENCHMARKS.md")
    p.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "bench_out")
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument("--no-markdown", action="store_true")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    p.add_argument("--decode-tokens", type=int, default=128, help="engines table: new tokens per row (0: skip)")
    p.add_argument("--decode-rows", type=int, default=4, help="engines table: prompts generated at once")
    p.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--decode-worker", help=argparse.SUPPRESS)
    p.add_argument("--trl-out", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.trl_worker is not None:
        trl_worker(json.loads(a.trl_worker.read_text()), a.trl_out)
        return
    if a.decode_worker is not None:
        path, rows, tokens, engine = json.loads(a.decode_worker)
        print(measure_decode(path, rows=rows, tokens=tokens, engine=engine))
        return
    shapes = ["tiny"] if a.smoke else [s for s in a.shapes.split(",") if s]
    if unknown := set(shapes) - set(SHAPES):
        p.error(f"unknown shapes {sorted(unknown)}")
    steps = 3 if a.smoke else a.steps
    if steps < 2:
        p.error("--steps must be at least 2 (the first is warm-up)")
    methods = [m for m in a.stacks.split(",") if m]
    if unknown := set(methods) - set(METHODS):
        p.error(f"unknown stacks {sorted(unknown)}")
    a.bench_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()[0]
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    works: dict[str, dict[str, Any]] = {}
    for shape in shapes:
        half = shape == "half"
        works[shape] = work = {
            "model": str(model_dir(a.bench_dir, shape)), "world": a.world, "steps": steps, "seed": 0, "lr": 1e-3,
            "batch": a.half_batch if half else a.batch, "generations": a.generations,
            "completion": a.half_completion if half else a.completion, "timeout": a.timeout,
            "trl_threads": a.trl_threads or a.world,
        }  # fmt: skip
        for repeat in range(a.repeats):
            for method in rotated(methods, repeat):
                out = a.bench_dir / f"grpo_{shape}_{method}"
                started = time.perf_counter()
                if method == "shardtune":
                    got = run_shardtune(work, out)
                else:
                    got = run_trl(work, out.with_suffix(".json"), fsdp=method == "trl_fsdp2")
                results.setdefault((shape, method), []).append(got)
                status = got.get("error") or f"{time.perf_counter() - started:.0f} s"
                print(f"[{repeat + 1}/{a.repeats}] {shape}/{method}: {status}", file=sys.stderr)
    decode: dict[tuple[str, str], list[dict[str, Any]]] = {}
    decode_tokens = 8 if a.smoke else a.decode_tokens
    for shape in shapes if decode_tokens > 0 else []:
        for repeat in range(a.repeats):
            for engine in rotated(list(DECODE_ENGINES), repeat):
                got = run_decode(
                    works[shape]["model"], rows=a.decode_rows, tokens=decode_tokens, engine=engine, timeout=a.timeout
                )
                decode.setdefault((shape, engine), []).append(got)
                print(f"[{repeat + 1}/{a.repeats}] {shape}/decode {engine}: {got}", file=sys.stderr)
    command = "python -m benchmarks.grpo " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = environment_lines(command, load_avg=(load_before, os.getloadavg()[0]), libraries=("transformers", "trl"))
    tables = report(results, works, world=a.world, trl_fsdp="trl_fsdp2" in methods)
    if decode:
        tables += ["", *decode_report(decode, rows=a.decode_rows, tokens=decode_tokens)]
    section = "\n".join([*lines, "", *tables])
    finish(section, markdown=None if (a.smoke or a.no_markdown) else a.markdown, markers=MARKERS)
    required = [r for (_, method), runs in results.items() if method != "trl_fsdp2" for r in runs]
    if any("error" in r for r in [*required, *(r for runs in decode.values() for r in runs)]):
        raise SystemExit(1)  # TRL under FSDP2 may not run on CPU: the table's notes say why


def _median_after_warmup(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [v for r in runs if "error" not in r for v in r[key][1:]]
    return statistics.median(values) if values else None


def report(
    results: dict[tuple[str, str], list[dict[str, Any]]],
    works: dict[str, dict[str, Any]],
    *,
    world: int,
    trl_fsdp: bool,
) -> list[str]:
    """The Markdown table: per shape and stack, medians after the warm-up step."""
    lines = [
        "| shape | stack | rollout tokens/s per rank | rollout tokens/s, all ranks | step s | step vs shardtune |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    notes = []
    for shape in works:
        base = _median_after_warmup(results.get((shape, "shardtune"), []), "step_s")
        for (s, method), runs in results.items():
            if s != shape:
                continue
            errors = [r["error"] for r in runs if "error" in r]
            if len(errors) == len(runs):
                lines.append(f"| {shape} | {method} | failed | | | |")
                notes.append(f"- {shape}/{method} did not run: `{errors[0]}`")
                continue
            gen = _median_after_warmup(runs, "gen_tokens_per_s")
            step = _median_after_warmup(runs, "step_s")
            ranks = world if method != "trl" else 1
            if gen is None or step is None:
                continue
            ratio = f"{step / base:.2f}x" if base else ""
            lines.append(f"| {shape} | {method} | {gen:.1f} | {gen * ranks:.1f} | {step:.2f} | {ratio} |")
            how = next((r["how"] for r in runs if "how" in r), None)
            if how is not None:
                sharded = not how.split(", ")[1].startswith("0 ")
                why = (
                    ""
                    if sharded or method == "trl"
                    else ": accelerate does not apply FSDP on CPU, so every process holds the whole model (DDP)"
                )
                notes.append(f"- {shape}/{method} ran as {how}{why}")
    describe = {
        "tiny": "the tiny/grpo model (Llama, hidden 256, 4 layers, vocab 256, byte tokenizer)",
        "half": f"Qwen2.5-0.5B-shaped Llama (hidden {HALF_B.hidden}, {HALF_B.layers} layers, 14/2 heads, ffn "
        f"{HALF_B.ffn}, vocab {HALF_B.vocab}; {HALF_B.params() / 1e9:.2f}B parameters)",
    }
    work_lines = [
        f"- {shape}: {describe[shape]}; per step {work['world'] * work['batch']} prompts x {work['generations']} "
        f"generations, max_completion_tokens {work['completion']}, {work['steps']} steps per run (the first not counted)"
        for shape, work in works.items()
    ]
    return [
        "GRPO step on CPU: shardtune's grpo_distributed (FSDP2 over "
        f"{world} gloo ranks, 1 thread each, its batched KV-cache generation) against TRL's GRPOTrainer "
        f"(`model.generate`; one process of {next(iter(works.values()))['trl_threads'] if works else world} "
        "threads, the same global generation batch). Same model "
        "files, prompts (the digit-sum asset), rewards, sampling, LoRA rank 8 on every projection, DAPO loss, "
        "beta 0, fp32. Rollout tokens/s: completion tokens (up to and with EOS) per second of generation, "
        "per rank and times the ranks; step s: one optimizer step, rollout included; medians after the "
        "warm-up step.",
        "",
        *work_lines,
        "",
        *lines,
        "",
        *notes,
        *(
            []
            if trl_fsdp
            else ["- TRL with accelerate FSDP2 on CPU was not run here (add trl_fsdp2 to --stacks to try it)."]
        ),
    ]


if __name__ == "__main__":
    main()
