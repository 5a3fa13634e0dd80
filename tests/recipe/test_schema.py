"""Tests for the typed YAML recipe loader (ecomla.recipe.schema)."""
from __future__ import annotations

import enum
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

import pytest
import yaml

from ecomla.recipe.schema import (
    RecipeError,
    asks_the_same,
    describe_fields,
    format_fields,
    knob,
    load_recipe,
    recipe_to_dict,
    save_recipe,
)


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass
class Mla:
    kv_lora_rank: int = knob(512, help="latent KV width")
    q_lora_rank: Optional[int] = knob(None, help="latent query width; null keeps full-rank queries")
    rope_dim: int = knob(64, help="decoupled RoPE head dim")

    def check(self) -> list[str]:
        problems = []
        if self.kv_lora_rank <= 0:
            problems.append("kv_lora_rank: must be positive")
        if self.q_lora_rank is not None and self.q_lora_rank < self.kv_lora_rank:
            problems.append("q_lora_rank: must be >= kv_lora_rank")
        return problems


@dataclass
class Init:
    method: Literal["svd", "activation", "random"] = knob("svd", help="how MLA weights are initialised")
    layers: list[int] = knob(default_factory=list, help="layers to convert; empty = all")

    def check(self) -> list[str]:
        if self.method == "random" and self.layers:
            return ["picking layers needs svd or activation init"]  # bare message
        return []


@dataclass
class Teacher:
    name: str = knob(help="teacher model id")
    temperature: float = knob(1.0, help="distillation temperature")


@dataclass
class Recipe:
    model: str = knob(help="HF model id to convert")
    precision: Precision = knob(Precision.BF16, help="compute dtype")
    mla: Mla = knob(default_factory=Mla, help="MLA shape")
    init: Init = knob(default_factory=Init, help="initialisation")
    teacher: Optional[Teacher] = knob(None, help="distillation teacher; null disables KD")
    loss_weights: dict[str, float] = knob(default_factory=dict, help="loss name -> weight")
    lr: float = knob(1e-4, help="peak learning rate")
    betas: tuple[float, ...] = knob((0.9, 0.95), help="AdamW betas")
    seed: int | str = knob(0, help="seed, or 'random'")
    output: Path | None = knob(None, help="output directory")
    extra: Any = knob(None, help="free-form notes")
    compile: bool = knob(False, help="torch.compile the student")

    def check(self) -> list[str]:
        problems = []
        if self.teacher is None and self.loss_weights.get("kd", 0.0) > 0:
            problems.append("loss_weights.kd: needs a teacher")
        if self.lr > 1:
            problems.append("lr looks like a percentage, not a rate")
        return problems


def write(tmp_path: Path, text: str, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def problems_of(*args, **kwargs) -> list[str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(Recipe, *args, **kwargs)
    return info.value.problems


FULL = """\
model: meta-llama/Llama-3.2-1B
precision: fp32
mla:
  kv_lora_rank: 256
  q_lora_rank: 768
init:
  method: activation
  layers: [0, 2, 5]
teacher:
  name: big-model
  temperature: 2
loss_weights: {kd: 1, ce: 0.5}
lr: 3e-4
betas: [0.8, 0.9]
seed: random
output: runs/x
extra: {anything: [1, 2]}
"""


def test_happy_path_from_yaml_file(tmp_path):
    r = load_recipe(Recipe, write(tmp_path, FULL))
    assert isinstance(r, Recipe)
    assert r.model == "meta-llama/Llama-3.2-1B"
    assert r.precision is Precision.FP32
    assert r.mla == Mla(kv_lora_rank=256, q_lora_rank=768, rope_dim=64)
    assert r.init == Init(method="activation", layers=[0, 2, 5])
    assert r.teacher == Teacher(name="big-model", temperature=2.0)
    assert isinstance(r.teacher.temperature, float)
    assert r.loss_weights == {"kd": 1.0, "ce": 0.5}
    assert all(isinstance(v, float) for v in r.loss_weights.values())
    assert r.lr == pytest.approx(3e-4) and isinstance(r.lr, float)  # YAML 1.1 would give the string '3e-4'
    assert r.betas == (0.8, 0.9) and isinstance(r.betas, tuple)
    assert r.seed == "random"
    assert r.output == Path("runs/x")
    assert r.extra == {"anything": [1, 2]}


def test_defaults_fill_absent_keys():
    r = load_recipe(Recipe, data={"model": "m"})
    assert r == Recipe(model="m")
    assert r.mla.kv_lora_rank == 512 and r.teacher is None and r.betas == (0.9, 0.95)
    assert r.precision is Precision.BF16


def test_all_problems_reported_together(tmp_path):
    path = write(tmp_path, "model: m\nmla:\n  kv_lora_rnak: 5\ninit:\n  method: svdd\nlr: fast\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(Recipe, path)
    err = info.value
    assert err.problems == [
        "mla.kv_lora_rnak: unknown key; did you mean 'kv_lora_rank'?",
        "init.method: 'svdd' is not one of 'svd', 'activation', 'random'; did you mean 'svd'?",
        "lr: expected float, got str 'fast'",
    ]
    assert err.source == str(path)
    assert str(err).startswith(f"{path} has 3 problem(s):\n  - mla.kv_lora_rnak: unknown key")


def test_unknown_key_without_close_match_lists_valid_keys():
    assert problems_of(data={"model": "m", "mla": {"zzz": 1}}) == [
        "mla.zzz: unknown key; valid keys: kv_lora_rank, q_lora_rank, rope_dim"]


def test_missing_required_keys_top_and_nested():
    assert problems_of(data={}) == ["model: required key is missing"]
    assert problems_of(data={"model": "m", "teacher": {}}) == ["teacher.name: required key is missing"]


def test_int_rejects_bool_float_and_str():
    assert problems_of(data={"model": "m", "mla": {"rope_dim": True, "kv_lora_rank": 1.5, "q_lora_rank": "abc"}}) == [
        "mla.kv_lora_rank: expected int, got float 1.5",
        "mla.q_lora_rank: expected int, got str 'abc'",
        "mla.rope_dim: expected int, got bool true",
    ]


def test_float_accepts_int_but_not_bool():
    r = load_recipe(Recipe, data={"model": "m", "lr": 1})
    assert r.lr == 1.0 and type(r.lr) is float
    assert problems_of(data={"model": "m", "lr": False}) == ["lr: expected float, got bool false"]


def test_str_rejects_numbers_and_bool_accepts_only_booleans(tmp_path):
    assert problems_of(data={"model": 123}) == ["model: expected str, got int 123"]
    assert load_recipe(Recipe, write(tmp_path, "model: m\ncompile: true\n")).compile is True
    assert problems_of(write(tmp_path, "model: m\ncompile: 1\n")) == ["compile: expected bool, got int 1"]
    assert problems_of(write(tmp_path, "model: m\ncompile: 'true'\n")) == ["compile: expected bool, got str 'true'"]


def test_enum_matched_by_value_not_name():
    assert load_recipe(Recipe, data={"model": "m", "precision": "fp32"}).precision is Precision.FP32
    assert problems_of(data={"model": "m", "precision": "bf15"}) == [
        "precision: 'bf15' is not one of 'fp32', 'bf16'; did you mean 'bf16'?"]
    assert problems_of(data={"model": "m", "precision": "BF16"})[0].startswith(
        "precision: 'BF16' is not one of 'fp32', 'bf16'")


def test_optional_nested_and_non_optional_nested_null():
    assert load_recipe(Recipe, data={"model": "m", "teacher": None}).teacher is None
    assert problems_of(data={"model": "m", "mla": None}) == ["mla: expected mapping, got null"]
    assert problems_of(data={"model": "m", "teacher": "big"}) == ["teacher: expected mapping, got str 'big'"]


def test_container_item_paths():
    assert problems_of(data={"model": "m", "init": {"layers": [1, "x", 3]},
                             "loss_weights": {"kd": "high"}, "betas": "0.9"}) == [
        "init.layers[1]: expected int, got str 'x'",
        "loss_weights.kd: expected float, got str 'high'",
        "betas: expected tuple[float, ...], got str '0.9'",
    ]


def test_union_tries_members_in_order():
    assert load_recipe(Recipe, data={"model": "m", "seed": 5}).seed == 5
    assert load_recipe(Recipe, data={"model": "m", "seed": "7"}).seed == "7"
    assert problems_of(data={"model": "m", "seed": 1.5}) == ["seed: expected int | str, got float 1.5"]


def test_overrides_convert_types_and_create_nested(tmp_path):
    path = write(tmp_path, "model: m\nmla: {kv_lora_rank: 128}\n")
    r = load_recipe(Recipe, path, overrides=[
        "mla.kv_lora_rank=64", "mla.q_lora_rank=null", "teacher.name=t", "teacher.temperature=3",
        "init.layers=[1,2]", "precision=fp32", "betas=[0.5, 0.6]", "model = other", "compile=true"])
    assert r.mla.kv_lora_rank == 64 and r.mla.q_lora_rank is None
    assert r.teacher == Teacher(name="t", temperature=3.0)
    assert r.init.layers == [1, 2] and r.precision is Precision.FP32 and r.betas == (0.5, 0.6)
    assert r.model == "other" and r.compile is True


def test_override_replaces_null_nested_and_does_not_mutate_data():
    data = {"model": "m", "teacher": None}
    r = load_recipe(Recipe, data=data, overrides=["teacher.name=t"])
    assert r.teacher == Teacher(name="t")
    assert data == {"model": "m", "teacher": None}


def test_override_problems_are_marked():
    assert problems_of(data={"model": "m"}, overrides=["mla.kv_lora_rnak=5", "abc", "mla.rope_dim=x"]) == [
        "--set 'abc': expected KEY=VALUE",
        "mla.kv_lora_rnak (from --set): unknown key; did you mean 'kv_lora_rank'?",
        "mla.rope_dim (from --set): expected int, got str 'x'",
    ]
    assert problems_of(data={"model": "m"}, overrides=["=5", "a..b=1"]) == [
        "--set '=5': expected KEY=VALUE", "--set 'a..b=1': expected KEY=VALUE"]


def test_override_into_scalar_and_bad_value():
    assert problems_of(data={"model": "m"}, overrides=["model.x=1"]) == [
        "model.x (from --set): cannot set a key inside 'model', which holds str 'm'"]
    # an intermediate mapping created by --set is attributed to --set too
    assert problems_of(data={}, overrides=["model.x=1"]) == ["model (from --set): expected str, got mapping"]
    bad = problems_of(data={"model": "m"}, overrides=["init.layers=[1,2"])
    assert len(bad) == 1 and bad[0].startswith("--set 'init.layers=[1,2': invalid YAML")


def test_file_values_are_not_marked_as_from_set(tmp_path):
    path = write(tmp_path, "model: m\nmla: {rope_dim: x}\n")
    assert problems_of(path, overrides=["mla.kv_lora_rank=1"]) == ["mla.rope_dim: expected int, got str 'x'"]


def test_check_problems_prefixed_with_dataclass_path():
    assert problems_of(data={"model": "m", "mla": {"kv_lora_rank": 256, "q_lora_rank": 128},
                             "init": {"method": "random", "layers": [1]},
                             "loss_weights": {"kd": 1}, "lr": 5}) == [
        "mla.q_lora_rank: must be >= kv_lora_rank",
        "init: picking layers needs svd or activation init",
    ]
    # top-level check runs once the subtree is clean: relative key kept, bare message as-is
    assert problems_of(data={"model": "m", "loss_weights": {"kd": 1}, "lr": 5}) == [
        "loss_weights.kd: needs a teacher", "lr looks like a percentage, not a rate"]


def test_check_skipped_when_own_fields_invalid_but_other_branches_reported():
    # kv_lora_rank=-1 would fail Mla.check, but rope_dim is mistyped so check() must not run
    assert problems_of(data={"model": "m", "mla": {"kv_lora_rank": -1, "rope_dim": "x"},
                             "init": {"method": "random", "layers": [1]}}) == [
        "mla.rope_dim: expected int, got str 'x'",
        "init: picking layers needs svd or activation init",
    ]


def test_recipe_to_dict_is_plain_yaml():
    r = load_recipe(Recipe, data={"model": "m", "precision": "fp32", "output": "o", "teacher": {"name": "t"}})
    d = recipe_to_dict(r)
    assert d["precision"] == "fp32" and d["output"] == "o" and d["betas"] == [0.9, 0.95]
    assert d["mla"] == {"kv_lora_rank": 512, "q_lora_rank": None, "rope_dim": 64}
    assert d["teacher"] == {"name": "t", "temperature": 1.0}
    assert yaml.safe_load(yaml.safe_dump(d)) == d


def test_save_then_load_round_trips(tmp_path):
    original = load_recipe(Recipe, write(tmp_path, FULL))
    out = tmp_path / "run" / "resolved.yaml"
    save_recipe(original, out)
    text = out.read_text()
    assert text.splitlines()[0] == "# resolved recipe written by ecomla"
    assert text.index("model:") < text.index("precision:") < text.index("mla:")  # field order kept
    assert load_recipe(Recipe, out) == original


def test_describe_fields_lists_nested_keys_with_help():
    rows = {row[0]: row for row in describe_fields(Recipe)}
    assert rows["model"] == ("model", "str", "required", "HF model id to convert")
    assert rows["mla"] == ("mla", "mapping", "{...}", "MLA shape")
    assert rows["mla.kv_lora_rank"] == ("mla.kv_lora_rank", "int", "512", "latent KV width")
    assert rows["mla.q_lora_rank"][1:3] == ("int | null", "null")
    assert rows["init.method"][1:3] == ("'svd' | 'activation' | 'random'", "svd")
    assert rows["teacher"][1:3] == ("mapping | null", "null")
    assert rows["teacher.name"][2] == "required"
    assert rows["precision"][1:3] == ("'fp32' | 'bf16'", "bf16")
    assert rows["betas"][1:3] == ("tuple[float, ...]", "[0.9, 0.95]")
    assert rows["loss_weights"][1:3] == ("dict[str, float]", "{}")
    assert list(rows)[:3] == ["model", "precision", "mla"]
    text = format_fields(Recipe)
    assert "mla.kv_lora_rank" in text and "latent KV width" in text and "KEY" in text.splitlines()[0]


def test_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(RecipeError) as info:
        load_recipe(Recipe, missing)
    assert info.value.problems == [f"{missing}: file not found"]
    bad = write(tmp_path, "model: [unclosed\n", "bad.yaml")
    with pytest.raises(RecipeError) as info:
        load_recipe(Recipe, bad)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"{bad}: invalid YAML at line")
    listed = write(tmp_path, "- a\n- b\n", "list.yaml")
    with pytest.raises(RecipeError) as info:
        load_recipe(Recipe, listed)
    assert info.value.problems == [f"{listed}: top level must be a mapping of keys, got list"]
    dup = write(tmp_path, "model: a\nmodel: b\n", "dup.yaml")
    with pytest.raises(RecipeError, match="duplicate key 'model'"):
        load_recipe(Recipe, dup)


def test_empty_file_is_empty_mapping(tmp_path):
    empty = write(tmp_path, "", "empty.yaml")
    assert problems_of(empty) == ["model: required key is missing"]
    assert load_recipe(Recipe, empty, overrides=["model=m"]) == Recipe(model="m")


def test_recipe_error_survives_pickling():
    err = RecipeError(["a: b"], "x.yaml")
    back = pickle.loads(pickle.dumps(err))
    assert back.problems == ["a: b"] and back.source == "x.yaml" and str(back) == str(err)
    assert str(RecipeError(["p"])) == "recipe has 1 problem(s):\n  - p"


@dataclass
class NoHelp:
    x: int = 1


@dataclass
class BadType:
    x: set = knob(default_factory=set, help="sets are not supported")


def test_schema_mistakes_are_type_errors():
    with pytest.raises(TypeError, match="knob"):
        load_recipe(NoHelp, data={})
    with pytest.raises(TypeError, match="unsupported"):
        load_recipe(BadType, data={})


@dataclass
class Part:
    path: str = knob(help="a file")
    cap: Optional[int] = knob(None, help="at most this many")


@dataclass
class Parts:
    parts: list[Part] = knob(default_factory=list, help="the parts")
    mla: Mla = knob(default_factory=lambda: Mla(rope_dim=32), help="a default instance unlike Mla's own")


def test_asks_the_same_takes_keys_added_since_at_their_default():
    new = recipe_to_dict(load_recipe(Recipe, data={"model": "m", "mla": {"kv_lora_rank": 64}}))
    old = {k: v for k, v in new.items() if k != "compile"}  # written before `compile` existed
    old["mla"] = {k: v for k, v in new["mla"].items() if k != "q_lora_rank"}
    assert asks_the_same(old, new, Recipe)
    assert asks_the_same(new, new, Recipe)
    # a key added since, set away from its default: the old run did not do that
    on = recipe_to_dict(load_recipe(Recipe, data={"model": "m", "mla": {"kv_lora_rank": 64}, "compile": True}))
    assert not asks_the_same(old, on, Recipe)
    # a value that differs, a key removed since, and a required key the old recipe lacks
    assert not asks_the_same({**old, "lr": 2e-4}, new, Recipe)
    assert not asks_the_same({**old, "warmup": 10}, new, Recipe)
    assert not asks_the_same({k: v for k, v in old.items() if k != "model"}, new, Recipe)
    # a key left out of both (a path the caller drops before hashing) is not compared
    assert asks_the_same({k: v for k, v in old.items() if k != "output"},
                         {k: v for k, v in new.items() if k != "output"}, Recipe)


def test_asks_the_same_reads_a_parent_default_instance_and_lists_of_recipe_classes():
    new = recipe_to_dict(load_recipe(Parts, data={"parts": [{"path": "a"}, {"path": "b", "cap": 3}]}))
    old = {"parts": [{"path": "a"}, {"path": "b", "cap": 3}], "mla": {"kv_lora_rank": 512, "q_lora_rank": None}}
    assert asks_the_same(old, new, Parts)  # mla.rope_dim added since at Parts' default of 32
    # or at Mla's own 64, which a recipe that gives an mla section without rope_dim gets
    assert asks_the_same(old, {**new, "mla": {**new["mla"], "rope_dim": 64}}, Parts)
    assert not asks_the_same(old, {**new, "mla": {**new["mla"], "rope_dim": 16}}, Parts)
    assert not asks_the_same({**old, "parts": [{"path": "a"}]}, new, Parts)  # one part fewer
    assert not asks_the_same({**old, "parts": [{"path": "a"}, {"path": "b"}]}, new, Parts)  # cap set since


def test_extends_merges_the_file_over_its_base_at_every_depth(tmp_path):
    """A file's keys merge over the recipe it extends: mappings key by key, lists and values replace, a null
    replaces too; the base may extend another (paths relative to each file) and --set applies last."""
    write(tmp_path, FULL, "root.yaml")
    (tmp_path / "family").mkdir()
    write(tmp_path, "extends: ../root.yaml\nmla: {q_lora_rank: 1024}\ninit: {layers: [1]}\n", "family/mid.yaml")
    leaf = write(tmp_path, "extends: mid.yaml\noutput: null\nteacher: {temperature: 3}\nloss_weights: {ce: 1}\n"
                 "lr: 1e-4\n", "family/leaf.yaml")
    r = load_recipe(Recipe, leaf, overrides=["mla.rope_dim=32"])
    assert r.mla == Mla(kv_lora_rank=256, q_lora_rank=1024, rope_dim=32)  # mid's key beside root's, then --set
    assert r.init == Init(method="activation", layers=[1])  # a list replaces, it does not append
    assert r.teacher == Teacher(name="big-model", temperature=3.0) and r.output is None  # a null replaces too
    assert r.loss_weights == {"kd": 1.0, "ce": 1.0}  # a mapping merges, key by key
    assert r.lr == pytest.approx(1e-4) and r.model == "meta-llama/Llama-3.2-1B" and r.betas == (0.8, 0.9)
    # the same recipe as the keys written out in one file: what runs, and what save_recipe writes beside a run
    flat = yaml.safe_load(FULL)
    flat.update(mla={"kv_lora_rank": 256, "q_lora_rank": 1024, "rope_dim": 32},
                init={"method": "activation", "layers": [1]}, output=None,
                teacher={"name": "big-model", "temperature": 3}, loss_weights={"kd": 1, "ce": 1}, lr=1e-4)
    assert recipe_to_dict(r) == recipe_to_dict(load_recipe(Recipe, data=flat))


def test_extends_problems_name_the_file_and_the_fix(tmp_path):
    child = write(tmp_path, "extends: nowhere.yaml\nmodel: m\n", "child.yaml")
    assert problems_of(child) == [f"{child}: extends: 'nowhere.yaml': {tmp_path / 'nowhere.yaml'}: file not found"]
    for value, got in (("[a.yaml]", "list"), ("''", "str ''"), ("null", "null")):
        bad = write(tmp_path, f"extends: {value}\nmodel: m\n", "bad.yaml")
        (problem,) = problems_of(bad)
        assert problem.startswith(f"{bad}: extends: give the path of the recipe") and problem.endswith(f"got {got}")
    write(tmp_path, "extends: b.yaml\nmodel: m\n", "a.yaml")
    write(tmp_path, "extends: a.yaml\n", "b.yaml")
    (problem,) = problems_of(tmp_path / "a.yaml")
    assert "closes a loop" in problem and problem.count("a.yaml") == 4  # the file, its value, and the loop a -> b -> a
    selfish = write(tmp_path, "extends: self.yaml\n", "self.yaml")
    assert "closes a loop" in problems_of(selfish)[0]
    broken = write(tmp_path, "model: [unclosed\n", "broken.yaml")
    child = write(tmp_path, "extends: broken.yaml\n", "child.yaml")
    (problem,) = problems_of(child)
    assert problem.startswith(f"{child}: extends: 'broken.yaml': {broken}: invalid YAML at line ")
    # a base's schema problems are reported like the file's own, after the merge
    write(tmp_path, "model: m\nlr: 7\nmla: {kv_lora_rank: 0}\n", "base.yaml")
    child = write(tmp_path, "extends: base.yaml\nmla: {q_lora_rank: 1}\n", "child.yaml")
    assert problems_of(child) == ["mla.kv_lora_rank: must be positive"]
    child = write(tmp_path, "extends: base.yaml\nmla: {kv_lora_rank: 8}\n", "child.yaml")
    assert problems_of(child) == ["lr looks like a percentage, not a rate"]
