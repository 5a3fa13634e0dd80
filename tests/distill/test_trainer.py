"""The training loop, launched as users launch it: loss falls, export loads, resume is exact, bad input fails early."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3ForCausalLM

from tests.distill import world as w


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer_dir, corpus_dir):
    return w.build_world(tmp_path_factory.mktemp("world"), tokenizer_dir, corpus_dir)


def _falls(rows, key="kd"):
    losses = [r[key] for r in rows]
    head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    return tail < 0.9 * head, losses


def test_one_process_kd_falls_and_exports_stock_checkpoint(world, tmp_path):
    out = tmp_path / "run"
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", w.recipe(world, out)))
    assert proc.returncode == 0, w.errors(proc)
    rows = w.metrics(out)
    assert [r["step"] for r in rows if not r.get("final_eval")] == list(range(1, 13))
    ok, losses = _falls(rows)
    assert ok, losses
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model) is DeepseekV3ForCausalLM
    assert (out / "final" / "tokenizer.json").exists() and (out / "final" / "ecomla_recipe.yaml").exists()
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "eval_kd" in final and final["eval_tokens"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
@pytest.mark.parametrize("stage, launcher, latent_norm", [(2, "deepspeed", "normalize"), (3, "torchrun", "normalize"),
                                                          (2, "torchrun", "linear"), (3, "torchrun", "linear")])
def test_two_processes_zero(world, tmp_path, stage, launcher, latent_norm):
    """Two processes under ZeRO-2 and ZeRO-3 train and export the stock checkpoint; a linear latent's
    natural-scale parametrization works on partitioned parameters too (ZeRO-3 gathers them for the division)."""
    out = tmp_path / f"z{stage}"
    config = str(w.ROOT / "recipes" / "deepspeed" / f"zero{stage}.json")
    r = w.recipe(world, out, deepspeed={"zero_stage": stage, "config": config}, train={"micro_batch_size": 1})
    if latent_norm == "linear":
        r["student"] = str(_linear_student(world, world["root"] / "linear"))
    with w.shm_leftovers() as left:
        proc = w.run(w.write_recipe(tmp_path / "r.yaml", r), procs=2, launcher=launcher)
    assert proc.returncode == 0, w.errors(proc)
    # DeepSpeed's launcher makes its CPU all-reduce keep a buffer per rank in /dev/shm; each rank removed its own
    # (torchrun sets no LOCAL_SIZE, so DeepSpeed makes none there and this holds trivially)
    assert not left, left
    ok, losses = _falls(w.metrics(out))
    assert ok, losses
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model) is DeepseekV3ForCausalLM
    student = AutoModelForCausalLM.from_pretrained(r["student"])
    moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), student.parameters()))
    assert moved > 0  # the export holds the trained weights, not the initial ones
    if latent_norm == "linear":  # exported at the stored scale again (a gain of ~1e-3, trained by a few %)
        gain = student.model.layers[0].input_layernorm.weight
        torch.testing.assert_close(model.model.layers[0].input_layernorm.weight, gain, rtol=0.1, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("procs, case", [(1, "normalize"), (2, "normalize"), (1, "linear"), (1, "ild")])
def test_resume_after_kill_reproduces_losses(world, tmp_path, procs, case):
    # 24 steps, checkpoints every 4, killed once 5 are logged: it resumes from step 4 or 8 of 24. A linear-latent
    # student trains through its natural-scale parametrization, and an ILD run adds the layer loss against the
    # student's source (the live teacher here): both must resume as exactly.
    extra = {"train": {"total_tokens": 256 * 24, **({"micro_batch_size": 1} if procs == 2 else {})}}
    if procs == 2:
        extra["deepspeed"] = {"zero_stage": 2}
    if case == "linear":
        extra["student"] = str(_linear_student(world, tmp_path / "linear"))
    if case == "ild":
        extra["loss"] = {"ild_weight": 1.0}
        extra["teacher"] = {"model": str(world["root"] / "base")}
    ref_out, cut_out = tmp_path / "ref", tmp_path / "cut"
    ref = w.run(w.write_recipe(tmp_path / "ref.yaml", w.recipe(world, ref_out, **extra)), procs)
    assert ref.returncode == 0, w.errors(ref)
    cut_recipe = w.write_recipe(tmp_path / "cut.yaml", w.recipe(world, cut_out, **extra))
    w.run_and_kill(cut_recipe, procs, cut_out / "metrics.jsonl", after_steps=5)
    assert not (cut_out / "final").exists(), "the run finished before it was killed"
    assert (cut_out / "checkpoints" / "latest").read_text().strip() < "step_00000024"
    resumed = w.run(cut_recipe, procs)
    assert resumed.returncode == 0, w.errors(resumed)
    assert "resumed from" in resumed.stdout
    want, got = w.metrics(ref_out), w.metrics(cut_out)
    assert len(want) == 25  # 24 steps and the final evaluation
    assert [r["step"] for r in got] == [r["step"] for r in want]  # nothing repeated, nothing skipped
    assert [r["data"] for r in got] == [r["data"] for r in want]  # the same sequences at every step
    for a, b in zip(want, got):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6, abs=1e-7), (a["step"], a["loss"], b["loss"])
        if case == "ild":
            assert a["ild"] == pytest.approx(b["ild"], rel=1e-6, abs=1e-7) and a["ild"] > 0, a["step"]


def test_cache_with_full_vocab_equals_live_teacher(world, tmp_path):
    vocab = AutoModelForCausalLM.from_pretrained(world["teacher"]).config.vocab_size
    live_out, cache_out = tmp_path / "live", tmp_path / "cached"
    live = w.run(w.write_recipe(tmp_path / "live.yaml", w.recipe(world, live_out, train={"total_tokens": 256 * 4})))
    assert live.returncode == 0, w.errors(live)
    teacher = {"model": str(world["teacher"]), "cache_dir": str(tmp_path / "cache"), "cache_topk": vocab}
    cached_recipe = w.recipe(world, cache_out, train={"total_tokens": 256 * 4}, teacher={**teacher, "source": "cache"})
    path = w.write_recipe(tmp_path / "cached.yaml", cached_recipe)
    import subprocess

    made = subprocess.run([str(w.BIN / "ecomla"), "teacher-cache", str(path), "--quiet"], capture_output=True,
                          text=True, env=w.env(), timeout=600)
    assert made.returncode == 0, w.errors(made)
    assert json.loads((tmp_path / "cache" / "meta.json").read_text())["topk"] == vocab
    cached = w.run(path)
    assert cached.returncode == 0, w.errors(cached)
    for a, b in zip(w.metrics(live_out), w.metrics(cache_out)):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"teacher": {"model": "MISMATCH"}}, "vocab size"),
        ({"data": {"train": {"dataset": "nowhere/train.jsonl"}}}, "nowhere/train.jsonl"),
        ({"data": {"train": {"dataset": "EMPTY"}}}, "empty (no documents)"),
        ({"train": {"global_batch_tokens": 192}}, "whole multiple"),
        ({"loss": {"kind": "forward_kll"}}, "did you mean 'forward_kl'"),
        ({"trian": {}}, "did you mean 'train'"),
    ],
)
def test_bad_input_fails_before_compute(world, tmp_path, tokenizer_dir, change, needle):
    from tests.tiny import make_source

    if change.get("teacher", {}).get("model") == "MISMATCH":
        other = make_source(tmp_path / "t", tokenizer_dir, vocab_size=400)
        change = {"teacher": {"model": str(other)}}
    if change.get("data", {}).get("train", {}).get("dataset") == "EMPTY":
        (tmp_path / "empty.jsonl").write_text("")
        change = {"data": {"train": {"dataset": str(tmp_path / "empty.jsonl")}}}
    r = w.recipe(world, tmp_path / "run")
    for key, value in change.items():
        if key in r and isinstance(value, dict):
            for k2, v2 in value.items():
                r[key][k2] = {**r[key][k2], **v2} if isinstance(v2, dict) and isinstance(r[key].get(k2), dict) else v2
        else:
            r[key] = value
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", r))
    assert proc.returncode == 2, w.errors(proc)
    assert needle in proc.stderr, w.errors(proc)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(world, tmp_path):
    """A teacher whose embedding rows of a few tokens are NaN: the step whose batch holds them must stop the run."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from ecomla.data.sampler import StepSampler

    tok = AutoTokenizer.from_pretrained(world["student"])
    clean = (world["corpus"] / "a_fit.jsonl").read_text().splitlines()
    poison_ids = set(tok("analysts expect rates")["input_ids"]) - {t for line in clean for t in tok(json.loads(line)["text"])["input_ids"]}
    assert poison_ids
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(clean + [json.dumps({"text": "analysts expect rates"})]) + "\n")
    teacher = tmp_path / "teacher"
    import shutil

    shutil.copytree(world["teacher"], teacher)
    sd = load_file(teacher / "model.safetensors")
    for t in poison_ids:
        sd["model.embed_tokens.weight"][t] = float("nan")
    save_file(sd, teacher / "model.safetensors", metadata={"format": "pt"})

    out = tmp_path / "run"
    r = w.recipe(world, out, teacher={"model": str(teacher)}, checkpoint={"every_steps": 1},
                 data={"train": {"dataset": str(data)}})
    # Which step meets the poisoned document (the last one packed) is fixed by the seed; pick a seed where it is >= 3.
    from ecomla.data.packing import pack, text_documents
    from ecomla.distill.data import pad_id

    seqs = list(pack(text_documents([json.loads(x)["text"] for x in clean] + ["analysts expect rates"], tok), 64, pad_id(tok)))
    for seed in range(50):
        sampler = StepSampler(len(seqs), 2, 2, 1, 0, seed)
        hit = next(s for s in range(10**6) if any(len(seqs) - 1 in sampler.indices(s, j) for j in range(2)))
        if 3 <= hit < 12:
            break
    r["train"]["seed"] = seed
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", r))
    assert proc.returncode != 0
    assert "non-finite loss at step" in proc.stderr, w.errors(proc)
    assert not (out / "final").exists()
    rows = w.metrics(out)
    assert [row["step"] for row in rows] == list(range(1, hit + 1))  # every step before the poisoned one
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{hit:08d}"


def _weights(path):
    return dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters())


def test_stage_schedule_freezes_what_it_should(world, tmp_path):
    """Attention-only for the whole run: attention moves, MLPs and embeddings stay bit-identical."""
    out = tmp_path / "run"
    r = w.recipe(world, out, train={"mode": "stages", "stages": [{"trainable": ["attention"], "fraction": 1.0}],
                                    "total_tokens": 256 * 3})
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", r))
    assert proc.returncode == 0, w.errors(proc)
    before, after = _weights(world["student"]), _weights(out / "final")
    for name, p in after.items():
        if ".self_attn." not in name:
            assert torch.equal(p, before[name]), f"{name} changed while frozen"
    assert any(not torch.equal(after[n], before[n]) for n in after if ".self_attn." in n)


def test_lr_multipliers_set_each_groups_learning_rate(world, tmp_path):
    """{mlp: 0}: the MLPs keep their weights while attention and the rest train at train.lr."""
    out = tmp_path / "run"
    r = w.recipe(world, out, train={"lr_multipliers": {"mlp": 0.0}, "total_tokens": 256 * 3})
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", r))
    assert proc.returncode == 0, w.errors(proc)
    before, after = _weights(world["student"]), _weights(out / "final")
    assert all(torch.equal(p, before[n]) for n, p in after.items() if ".mlp." in n)
    assert any(not torch.equal(after[n], before[n]) for n in after if ".self_attn." in n)
    assert any(not torch.equal(after[n], before[n]) for n in after if "embed_tokens" in n)


def test_lora_merges_into_a_stock_checkpoint(world, tmp_path):
    out = tmp_path / "run"
    r = w.recipe(world, out, train={"mode": "lora", "lora": {"r": 4, "alpha": 8.0}, "total_tokens": 256 * 3, "lr": 1e-2})
    proc = w.run(w.write_recipe(tmp_path / "r.yaml", r))
    assert proc.returncode == 0, w.errors(proc)
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert type(model) is DeepseekV3ForCausalLM
    before, after = _weights(world["student"]), _weights(out / "final")
    assert set(before) == set(after)  # no adapter tensors left after merging
    targets = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    changed = {n for n in after if not torch.equal(after[n], before[n])}
    assert changed and all(any(t in n for t in targets) for n in changed), changed


def test_pretrain_is_the_same_loop_with_ce(world, tmp_path):
    out = tmp_path / "run"
    r = w.recipe(world, out, train={"total_tokens": 256 * 12, "lr": 1e-2})
    del r["student"], r["teacher"]
    r["student_config"] = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
                           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    r["tokenizer"] = str(world["student"])
    import subprocess

    proc = subprocess.run([str(w.BIN / "ecomla"), "pretrain", str(w.write_recipe(tmp_path / "r.yaml", r)), "--quiet"],
                          capture_output=True, text=True, env=w.env(), timeout=600)
    assert proc.returncode == 0, w.errors(proc)
    ok, losses = _falls(w.metrics(out), key="ce")
    assert ok, losses
    assert all(row["kd"] == 0 for row in w.metrics(out))
    assert AutoModelForCausalLM.from_pretrained(out / "final").config.model_type == "llama"


@pytest.mark.slow
def test_prepared_shards_train_like_in_memory_data(world, tmp_path):
    import subprocess

    mem_out, prep_out = tmp_path / "mem", tmp_path / "prep"
    mem = w.run(w.write_recipe(tmp_path / "mem.yaml", w.recipe(world, mem_out, train={"total_tokens": 256 * 3})))
    assert mem.returncode == 0, w.errors(mem)
    prep_recipe = w.write_recipe(tmp_path / "prep.yaml", w.recipe(world, prep_out, train={"total_tokens": 256 * 3}))
    made = subprocess.run([str(w.BIN / "ecomla"), "prepare-data", str(prep_recipe)], capture_output=True, text=True,
                          env=w.env(), timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    assert (prep_out / "data" / "train" / "meta.json").exists()
    run = w.run(prep_recipe)  # the same recipe now reads the shards prepare-data wrote into its output_dir
    assert run.returncode == 0, w.errors(run)
    assert f"prepared shards in {prep_out / 'data' / 'train'}" in run.stdout
    # and they can be named explicitly, e.g. from another run
    r = w.recipe(world, tmp_path / "named", train={"total_tokens": 256 * 3})
    r["data"]["train"] = {"prepared": str(prep_out / "data" / "train")}
    named = w.run(w.write_recipe(tmp_path / "named.yaml", r))
    assert named.returncode == 0, w.errors(named)
    assert [x["loss"] for x in w.metrics(tmp_path / "named")] == [x["loss"] for x in w.metrics(prep_out)]
    for a, b in zip(w.metrics(mem_out), w.metrics(prep_out)):
        assert a["data"] == b["data"] and a["loss"] == pytest.approx(b["loss"], rel=1e-6)


def _linear_student(world, path):
    from tests.convert.helpers import convert

    if not path.exists():
        convert(world["root"] / "base", path, mla={"kv_lora_rank": 16, "qk_rope_head_dim": 8, "latent_norm": "linear"})
    return path


def test_a_linear_latent_student_trains_at_natural_scale_and_is_refused_under_lora(world, tmp_path):
    """A linear-latent student (its latent's scale stored in weights of ~1e-3 to ~1e3): full training trains each
    scaled tensor at its natural size, the latent basis included unless train.latent_basis says freeze, so its KD
    loss falls like any student's; the export keeps the layout in config.json. LoRA would train adapters at the
    wrong scale, so it is refused before compute."""
    from safetensors.torch import load_file

    from ecomla.convert import layout

    student = _linear_student(world, tmp_path / "linear")
    before = load_file(student / "model.safetensors")
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    for basis in ("train", "freeze"):
        r = w.recipe(world, tmp_path / basis, train={"latent_basis": basis})
        r["student"] = str(student)
        proc = w.run(w.write_recipe(tmp_path / f"{basis}.yaml", r))
        assert proc.returncode == 0, w.errors(proc)
        ok, losses = _falls(w.metrics(tmp_path / basis))
        assert ok, losses
        after = load_file(tmp_path / basis / "final" / "model.safetensors")
        assert torch.equal(before[kv_a][:16], after[kv_a][:16]) == (basis == "freeze")  # the latent rows
        assert not torch.equal(before[kv_a][16:], after[kv_a][16:])  # the RoPE-key rows: trained
        config = json.loads((tmp_path / basis / "final" / "config.json").read_text())
        assert config[layout.CONFIG_KEY] == json.loads((student / "config.json").read_text())[layout.CONFIG_KEY]
    # The trained basis keeps its layer finite in half-precision activations (the latent is ~1e-5 before its norm)
    ids = torch.randint(0, 200, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(tmp_path / "train" / "final", dtype=torch.float32)(ids).logits
        for dtype in (torch.float16, torch.bfloat16):
            half = AutoModelForCausalLM.from_pretrained(tmp_path / "train" / "final", dtype=dtype)(ids).logits.float()
            assert torch.isfinite(half).all(), dtype
            assert (half.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9, dtype

    r = w.recipe(world, tmp_path / "lora", train={"mode": "lora"})
    r["student"] = str(student)
    proc = w.run(w.write_recipe(tmp_path / "lora.yaml", r))
    assert proc.returncode == 2, w.errors(proc)
    assert "mla.latent_norm: linear" in proc.stderr and "train.mode: full" in proc.stderr, w.errors(proc)
    assert not (tmp_path / "lora" / "checkpoints").exists()


@pytest.mark.slow
def test_a_distilled_linear_student_distils_again_from_its_final(world, tmp_path):
    """Two distillations in a row (e.g. ILD, then KD): the second starts from the first's final/, which has no
    conversion report. Its config.json carries the layout, so the second run takes exactly the steps of a run
    whose scale is known from the report; without either (the checkpoint as it was before) the steps differ."""
    import shutil

    from ecomla.convert import layout

    student = _linear_student(world, tmp_path / "linear")
    short = {"total_tokens": 256 * 4}
    first = w.recipe(world, tmp_path / "first", train=short)
    first["student"] = str(student)
    proc = w.run(w.write_recipe(tmp_path / "first.yaml", first))
    assert proc.returncode == 0, w.errors(proc)
    final = tmp_path / "first" / "final"
    assert not (final / "conversion_report.json").exists()
    variants = {"final": final}
    for name, report in (("known by its report", True), ("unknown", False)):
        copy = tmp_path / name
        shutil.copytree(final, copy)
        config = json.loads((copy / "config.json").read_text())
        del config[layout.CONFIG_KEY]
        (copy / "config.json").write_text(json.dumps(config))
        if report:
            shutil.copy2(student / "conversion_report.json", copy)
        variants[name] = copy
    losses = {}
    for name, start in variants.items():
        second = w.recipe(world, tmp_path / f"second {name}", train=short)
        second["student"] = str(start)
        proc = w.run(w.write_recipe(tmp_path / f"second {name}.yaml", second))
        assert proc.returncode == 0, w.errors(proc)
        losses[name] = [x["loss"] for x in w.metrics(tmp_path / f"second {name}") if not x.get("final_eval")]
    assert losses["final"] == losses["known by its report"], losses
    assert losses["final"] != losses["unknown"], losses


_FORCED_REDUCE = """
import sys
from ecomla.distill.recipe import load_distill_recipe
from ecomla.distill.trainer import DistillRun

job = DistillRun(load_distill_recipe(sys.argv[1], []), progress=False)
job.setup()
assert job.skip_reduce  # one process, ZeRO-0, fp32: the reduction is skipped unless told otherwise
job.skip_reduce = sys.argv[2] == "skip"
job.train()
"""


@pytest.mark.parametrize("case", ["kd", "ild alone, weight decay"])
def test_one_process_skips_deepspeeds_reduction_without_changing_a_bit(world, tmp_path, case):
    """One process under ZeRO-0 runs backward in DeepSpeed's no_sync (the all-reduce over one rank only copies
    the gradients through a flat buffer): the trained weights equal, bit for bit, those of a run that reduces,
    with gradient accumulation (2 micro-batches per step) so that no_sync spans several backwards. ILD alone
    leaves the final norm and head without gradients, which the reduction zero-fills, so weight decay moves them."""
    weights = {}
    extra = {} if case == "kd" else {"loss": {"kind": "none", "kd_weight": 0.0, "ce_weight": 0.0, "ild_weight": 1.0}}
    decay = {} if case == "kd" else {"weight_decay": 0.1}
    for mode in ("skip", "reduce"):
        out = tmp_path / mode
        r = w.recipe(world, out, train={"total_tokens": 256 * 3, "micro_batch_size": 1, **decay},
                     checkpoint={"every_steps": 0}, **extra)
        if case != "kd":  # the student's own source (a Llama) serves ILD
            r["teacher"] = {"model": str(world["root"] / "base")}
        path = w.write_recipe(tmp_path / f"{mode}.yaml", r)
        proc = subprocess.run([sys.executable, "-c", _FORCED_REDUCE, str(path), mode], capture_output=True,
                              text=True, timeout=600, env=w.env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        weights[mode] = _weights(out / "final")
    before = _weights(world["student"])
    assert any(not torch.equal(p, before[n]) for n, p in weights["skip"].items())
    if case != "kd":  # no gradient reached the final norm: weight decay alone moved it
        assert not torch.equal(weights["skip"]["model.norm.weight"], before["model.norm.weight"])
    for name, p in weights["skip"].items():
        assert torch.equal(p, weights["reduce"][name]), name
