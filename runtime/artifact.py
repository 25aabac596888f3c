"""An exported artifact opened for serving: its manifest, checked against the graph, and its session.

Everything the decode loop needs comes from the manifest (sizes, dtypes, IO names, cache kind and
limits, special tokens); the ONNX graph's inputs and outputs must say the same, or loading stops here
with a message rather than failing deep inside onnxruntime.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from runtime import custom_ops
from runtime.contract import (
    FORMAT_VERSION,
    LOGITS_TO_KEEP,
    MANIFEST_NAME,
    PAST_PREFIX,
    PRESENT_PREFIX,
    ROWS_AXIS,
    SHIFT_STATES_TEMPLATE,
    WINDOW_OFFSETS,
)
from runtime.errors import ArtifactError

ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(int64)": "int64",
             "tensor(bfloat16)": "bfloat16"}  # fmt: skip
PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


@dataclass(frozen=True)
class SessionOptions:
    provider: str = "auto"  # auto (CUDA when it works here, else CPU), cuda or cpu
    intra_op_threads: int = 0  # 0: onnxruntime's default
    optimization: str = "all"  # disable, basic, extended or all
    optimized_model_path: Path | None = None  # save the optimized graph here (and reuse it if it exists)
    profile_prefix: str | None = None  # onnxruntime's profiler on, its trace written as <prefix>_<time>.json


OPTIMIZATION_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def is_artifact(folder: str | Path) -> bool:
    """Whether `folder` holds a manifest, as every kvg-export artifact does (read_manifest then checks it)."""
    return (Path(folder) / MANIFEST_NAME).is_file()


def read_manifest(folder: Path) -> dict:
    """The artifact's manifest, checked for its format; raise ArtifactError saying what is wrong and the fix."""
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise ArtifactError(f"{folder} is not an artifact folder (make one with `kvg-export MODEL --out {folder}`)")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ArtifactError(f"{folder} has no {MANIFEST_NAME}; is it a kvg-export artifact?") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path} is not valid JSON ({error}); re-export the model") from None
    if manifest.get("format_version") != FORMAT_VERSION:
        raise ArtifactError(
            f"{path} has format_version {manifest.get('format_version')!r}; this runtime reads {FORMAT_VERSION}: "
            f"re-export the model (`kvg-export MODEL --out {folder} --force`)"
        )
    return manifest


def _check_graph(session: ort.InferenceSession, manifest: dict, folder: Path) -> None:
    problems = []
    checked = (("input", session.get_inputs()), ("optional_input", session.get_overridable_initializers()),
               ("output", session.get_outputs()))  # fmt: skip
    for kind, actual in checked:
        expected = manifest.get(f"{kind}s", [])
        if [a.name for a in actual] != [e["name"] for e in expected]:
            problems.append(
                f"{kind} names differ: graph {[a.name for a in actual]}, manifest {[e['name'] for e in expected]}"
            )
            continue
        for a, e in zip(actual, expected, strict=True):
            if ORT_TYPES.get(a.type, a.type) != e["dtype"] or len(a.shape) != len(e["axes"]):
                problems.append(
                    f"{kind} {a.name}: graph {a.type} rank {len(a.shape)}, manifest {e['dtype']} rank {len(e['axes'])}"
                )
    if problems:
        raise ArtifactError(
            f"{folder}: the graph does not match {MANIFEST_NAME}; re-export it:\n  " + "\n  ".join(problems)
        )


def attention_of(manifest: dict) -> str:
    """How the graph attends: "standard" (ONNX MatMul and Softmax), "fused" (the fused FoX operator, whose library
    the artifact carries; CPU), "gqa" (onnxruntime's GroupQueryAttention, which takes a later chunk of a prompt for
    one row only) or "onnx-attention" (ONNX Attention over a static buffer that TensorScatter writes). Artifacts
    made before the field existed are standard."""
    return manifest.get("attention", "standard")


def window_kind(manifest: dict) -> str:
    """Where the graph takes window_offsets (exporters/graph/passes/window_offsets.py): each head's own window ("head"),
    or each layer's in an artifact exported before heads had theirs ("layer"); else one window for all ("one")."""
    offsets = next((e for e in manifest.get("optional_inputs", []) if e["name"] == WINDOW_OFFSETS), None)
    return "one" if offsets is None else "head" if len(offsets["axes"]) == 2 else "layer"


def runs_keep_head_windows(manifest: dict) -> bool:
    """Whether a run of several tokens can follow decode steps that pruning has left with staggered heads: so unless
    the artifact was exported before a chunk could keep each head's own window."""
    return window_kind(manifest) != "head" or manifest["cache"].get("heads_apart_in_chunks", False)


def unrunnable(provider: str, manifest: dict) -> str | None:
    """Why `provider` ("cpu" or "cuda") cannot run this artifact's graph, and what fixes it; None if it can."""
    dtype, attention = manifest["dtype"], attention_of(manifest)
    if provider == "cpu" and dtype == "bfloat16":
        return (
            "this bf16 artifact runs on CUDA only (onnxruntime's CPU provider has no bf16 MatMul); serve it on a "
            "machine with CUDA, or re-export with --dtype fp16"
        )
    if provider == "cuda" and attention == "fused":
        return (
            "this artifact attends through the fused FoX operator, which runs on the CPU; serve it with --provider "
            "cpu, or re-export it for CUDA with --provider cuda"
        )
    if provider == "cuda" and attention == "gqa" and dtype == "float32":
        return (
            "this fp32 artifact attends through GroupQueryAttention, which onnxruntime runs on CUDA in fp16 and "
            "bf16 only; serve it with --provider cpu, or re-export it for CUDA with --provider cuda (fp32 with "
            "--cache static attends through onnx-attention) or with --dtype fp16"
        )
    return None


def _providers(choice: str, manifest: dict) -> tuple[list, bool]:
    """The session's providers, CUDA first where it can run the graph, and whether CUDA is required (asked
    for, or the only one that can run it); fp32 graphs keep fp32 matmuls (no TF32) so they match eager."""
    if choice not in ("auto", *PROVIDERS):
        raise ArtifactError(f"provider must be auto, cuda or cpu, not {choice!r}")
    runnable = [p for p in (("cuda", "cpu") if choice == "auto" else (choice,)) if not unrunnable(p, manifest)]
    if not runnable:
        raise ArtifactError(unrunnable(choice if choice != "auto" else "cpu", manifest))
    if runnable == ["cpu"]:
        return [PROVIDERS["cpu"]], False
    cuda = (PROVIDERS["cuda"], {"use_tf32": "0" if manifest["dtype"] == "float32" else "1"})
    return [cuda, PROVIDERS["cpu"]], "cpu" not in runnable


def open_session(folder: Path, manifest: dict, options: SessionOptions) -> ort.InferenceSession:
    """The onnxruntime session on the chosen provider; `cuda` that cannot start here is an error, not a fallback."""
    settings = ort.SessionOptions()
    settings.graph_optimization_level = OPTIMIZATION_LEVELS[options.optimization]
    settings.intra_op_num_threads = options.intra_op_threads
    if options.profile_prefix is not None:
        settings.enable_profiling, settings.profile_file_prefix = True, options.profile_prefix
    model_path = folder / manifest["files"]["model"]
    if options.optimized_model_path is not None:
        if options.optimized_model_path.is_file():
            model_path = options.optimized_model_path
        else:  # its weights beside it, as the artifact's are beside model.onnx
            settings.optimized_model_filepath = str(options.optimized_model_path)
            weights = f"{options.optimized_model_path.name}.data"
            settings.add_session_config_entry("session.optimized_model_external_initializers_file_name", weights)
    if not model_path.is_file():
        raise ArtifactError(f"{model_path} is missing; re-export the model")
    _register_custom_ops(settings, folder, manifest)
    providers, cuda_required = _providers(options.provider, manifest)
    if cuda_required and PROVIDERS["cuda"] not in ort.get_available_providers():
        raise ArtifactError(_no_cuda(options.provider, manifest))
    ort.set_default_logger_severity(4)  # a CUDA provider that cannot start is reported below, not logged
    try:
        session = ort.InferenceSession(str(model_path), settings, providers=providers)
    except Exception as error:  # onnxruntime's own exception types: a corrupt or unreadable graph
        fallback = " (if CUDA did not start here, the CPU provider that took over cannot run this graph)"
        cause = fallback if cuda_required else ""
        raise ArtifactError(f"onnxruntime cannot load {model_path}: {error}{cause}") from None
    finally:
        ort.set_default_logger_severity(2)
    if cuda_required and PROVIDERS["cuda"] not in session.get_providers():
        raise ArtifactError(_no_cuda(options.provider, manifest))
    _check_graph(session, manifest, folder)
    return session


def _register_custom_ops(settings: ort.SessionOptions, folder: Path, manifest: dict) -> None:
    """Register the library of the custom ops the graph uses, where the manifest names one (runtime/custom_ops.py)."""
    if manifest.get("custom_ops"):
        try:
            custom_ops.register(settings, folder, manifest["custom_ops"])
        except ValueError as error:
            raise ArtifactError(str(error)) from None


def session_options(folder: str | Path) -> ort.SessionOptions:
    """onnxruntime SessionOptions that open `folder`'s model.onnx as any onnxruntime user would: with the artifact's
    custom-op library registered where its manifest names one (else as they are)."""
    folder = Path(folder)
    settings = ort.SessionOptions()
    _register_custom_ops(settings, folder, read_manifest(folder))
    return settings


def _no_cuda(choice: str, manifest: dict) -> str:
    if choice == "cuda":
        return "--provider cuda: CUDA is not available to onnxruntime here; use --provider cpu or auto"
    return f"CUDA is not available to onnxruntime here, and {unrunnable('cpu', manifest)}"


@dataclass
class Artifact:
    folder: Path
    manifest: dict
    session: ort.InferenceSession

    @classmethod
    def open(cls, folder: str | Path, options: SessionOptions | None = None) -> Artifact:
        folder = Path(folder)
        manifest = read_manifest(folder)
        return cls(folder, manifest, open_session(folder, manifest, options or SessionOptions()))

    @property
    def device(self) -> str:
        return "cuda" if self.session.get_providers()[0] == PROVIDERS["cuda"] else "cpu"

    @property
    def static(self) -> bool:
        return self.manifest["cache"]["kind"] == "static"

    @property
    def attention(self) -> str:
        return attention_of(self.manifest)

    @property
    def weights(self) -> str:
        """What the weights are, for a user's first line: "float32 weights" or e.g. "int4 weights (rtn, block 32,
        accuracy level 4; in float: fgate, embedding)"."""
        quantization = self.manifest.get("quantization")
        if not quantization:
            return f"{self.manifest['dtype']} weights"
        kept = ", ".join(quantization["keep_float"]) or "nothing"
        return (
            f"{quantization['dtype']} weights ({quantization['method']}, block {quantization['block_size']}, "
            f"accuracy level {quantization['accuracy_level']}; in {self.manifest['dtype']}: {kept})"
        )

    @property
    def vocab_size(self) -> int:
        return self.manifest["model"]["vocab_size"]

    def past_names(self) -> list[str]:
        return [e["name"] for e in self.manifest["inputs"] if e["name"].startswith(PAST_PREFIX)]

    def present_names(self) -> list[str]:
        return [e["name"] for e in self.manifest["outputs"] if e["name"].startswith(PRESENT_PREFIX)]

    def shift_states(self) -> dict[str, str]:
        """Each shift state's past input -> the output of its value after each token of a run, where the graph gives
        them (a fused FoX-Pro graph, exporters/graph/passes/shift_states.py); else empty."""
        outputs = {e["name"] for e in self.manifest["outputs"]}
        named = {past: SHIFT_STATES_TEMPLATE.format(layer=layer, field=field)
                 for past in self.past_names() for _, layer, field in [past.rsplit(".", 2)]}  # fmt: skip
        return {past: name for past, name in named.items() if name in outputs}

    def gate_names(self) -> list[str]:
        """Each layer's gate input, layer by layer: what forget-gate pruning reads."""
        return [name for name in self.past_names() if name.endswith(".gate")]

    def takes(self, optional_input: str) -> bool:
        """Whether the graph takes this optional input (an artifact exported before it existed does not)."""
        return any(entry["name"] == optional_input for entry in self.manifest.get("optional_inputs", []))

    @property
    def keeps_logits(self) -> bool:
        """Whether the graph takes `logits_to_keep` (exporters/graph/passes/last_logits.py): a prefill's logits can then
        be its last position's alone."""
        return self.takes(LOGITS_TO_KEEP)

    def input_spec(self, name: str) -> dict:
        return next(e for e in self.manifest["inputs"] if e["name"] == name)

    def folds(self, present: str) -> bool:
        """Whether output `present` is a key or value buffer that a run whose layer's heads are staggered gives
        with its heads folded into rows, `[batch * kv_heads, 1, length, head_dim]`
        (exporters/graph/passes/window_offsets.py):
        the past's buffer is then bound to it in that shape."""
        entry = next(e for e in self.manifest["outputs"] if e["name"] == present)
        return entry["axes"][0] == ROWS_AXIS
