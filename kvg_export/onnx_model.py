"""transformers' `generate()` on an exported artifact: an onnxruntime session in the place of the model.

`OnnxFoxForCausalLM.from_pretrained(artifact_folder)` gives the whole transformers generation API (greedy,
sampling, beam search, logits processors, stopping criteria, streamers) over the artifact's graph. Its cache
is this project's gated cache, whose torch tensors live on the session's device and are bound to the
session by address (IOBinding), so nothing goes through host memory between steps:
- a static artifact's keys, values and gates are one buffer each, bound as past and present, which the
  graph writes in place; its shift states are copied back into their buffers after each step;
- a dynamic artifact's presents are new tensors, `past + seq` long, that become the next step's pasts.
Beam search reorders the cache's tensors (`reorder_cache`), as it does the eager model's. Assisted decoding
(`prompt_lookup_num_tokens`, `assistant_model`) crops the cache after each round; a FoX-Pro cache then feeds the
tokens a crop cannot keep again (see `GatedCache.crop`).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from kvg_export.cache import DynamicCache, GatedCache, StaticCache
from kvg_export.cache_layers import DynamicLayer
from kvg_export.fox.configuration import FoxConfig
from kvg_export.fox.modeling import PREFILL_CHUNK
from runtime import contract as io
from runtime.artifact import Artifact, SessionOptions
from runtime.cache.buffers import element_type

ATTRIBUTES = {"key": "keys", "value": "values", "gate": "gates", "key_shift": "key_shift",
              "value_shift": "value_shift"}  # fmt: skip
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CONTRACT_DTYPES = {torch_dtype: name for name, torch_dtype in TORCH_DTYPES.items()} | {torch.int64: "int64"}
# Tokens a crop left to feed again beyond which they run on their own before the caller's, so that the shift states
# are kept after them: else, while rounds refuse drafts, each would feed all since the first of them again (after a
# refused first round, the prompt)
REFEED_ALONE = 16


class OnnxFoxForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = FoxConfig
    main_input_name = "input_ids"

    def __init__(self, config: FoxConfig, artifact: Artifact):
        super().__init__(config)
        self.artifact = artifact
        self.session_device = torch.device("cuda", 0) if artifact.device == "cuda" else torch.device("cpu")
        self.fields = list(artifact.manifest["cache"]["fields"])  # each layer's cache tensors, in order
        self.dtype_name = artifact.manifest["dtype"]
        # The fields a run gives new tensors for: all of them on a dynamic cache, the shift states on a static one
        # (its keys, values and gates are written where they lie)
        self.written_fields = [f for f in self.fields if not artifact.static or io.is_shift_state(f)]
        self.shift = [ATTRIBUTES[f] for f in self.fields if io.is_shift_state(f)]

    @classmethod
    def from_pretrained(cls, folder: str | Path, provider: str = "auto", threads: int = 0):
        """The artifact in `folder` on `provider` (auto: CUDA where it can run the graph, else the CPU); `threads`:
        onnxruntime's intra-op threads (0: its default)."""
        folder = Path(folder)
        artifact = Artifact.open(folder, SessionOptions(provider, threads))
        model = cls(FoxConfig.from_pretrained(folder), artifact)
        if (folder / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(folder)
        return model.eval()

    @property
    def device(self) -> torch.device:
        return self.session_device

    @property
    def dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype_name]

    @property
    def static(self) -> bool:
        return self.artifact.static

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ):
        """generate() gets the cache the artifact was exported for: static buffers of its length, allocated on the
        session's device for every row (beams included), or a dynamic cache."""
        if model_kwargs.get("past_key_values") is None and generation_config.use_cache is not False:
            rows = batch_size * max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
            model_kwargs["past_key_values"] = self.new_cache(rows)

    def new_cache(self, rows: int) -> GatedCache:
        limit = self.artifact.manifest["cache"]["max_batch"]
        if rows > limit:
            raise ValueError(f"{rows} rows (batch times beams) exceed this artifact's max_batch {limit}; re-export it")
        if not self.static:
            return DynamicCache()
        config = self.config
        cache = StaticCache(config.num_hidden_layers, self.artifact.manifest["cache"]["max_cache_len"], rows)
        cache.early_initialization(
            rows, config.kv_heads, config.num_heads, config.head_dim, self.dtype, self.device, shift=self.shift
        )
        for layer in cache.layers:  # a session runs it, never torch.compile; transformers' assisted decoding
            layer.is_compileable = False  # refuses compileable layers
        return cache

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values: GatedCache | None = None,
        cache_position: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """New tokens through the session: input_ids `[batch, seq]`, attention_mask `[batch, past + seq]` (the
        attention window of a static cache), the cache (a new one when None) and the new tokens' slots. A longer
        input runs in chunks of PREFILL_CHUNK tokens, as the eager model and the runtime prefill, so no run holds
        more than a chunk's attention terms. `logits_to_keep` n > 0 (generate() passes 1) returns the last n
        positions' logits only, and the graph computes no others where it can (see
        exporters/graph/passes/last_logits.py).
        Tokens a crop left to feed again (see `GatedCache.crop`) go first, and their logits are not returned."""
        batch, seq = input_ids.shape
        cache = past_key_values if past_key_values is not None else self.new_cache(batch)
        filled = cache.get_seq_length()
        if cache_position is None:
            cache_position = torch.arange(filled, filled + seq)
        if attention_mask is None:
            attention_mask = torch.ones(batch, filled + seq, dtype=torch.long)
        again = cache.take_again()
        if again is not None:
            slots = torch.arange(filled - again.shape[1], filled, device=cache_position.device)
            if again.shape[1] > REFEED_ALONE:  # a run of their own, after which the states are kept
                self._feed(again, attention_mask[:, :filled], cache, slots, 1)
                cache.checkpoint()
            else:
                input_ids, cache_position = torch.cat([again, input_ids], dim=1), torch.cat([slots, cache_position])
                logits_to_keep = logits_to_keep or seq
        logits = self._feed(input_ids, attention_mask, cache, cache_position, logits_to_keep)
        return CausalLMOutputWithPast(logits=logits, past_key_values=cache)

    def _feed(self, input_ids, attention_mask, cache: GatedCache, cache_position, logits_to_keep: int) -> torch.Tensor:
        """Run `input_ids` by chunks (see `forward`), recorded in a cache of shift states for a crop to feed again."""
        if self.shift:
            cache.feed(input_ids)
        seq = input_ids.shape[1]
        if seq <= PREFILL_CHUNK:  # a decode step: no slicing, and no read of a device position back to the host
            logits = self._chunk(input_ids, attention_mask, cache, cache_position, self._kept(logits_to_keep, seq, seq))
        else:
            logits = []
            for begin in range(0, seq, PREFILL_CHUNK):
                slots = cache_position[begin : begin + PREFILL_CHUNK]
                mask = attention_mask[:, : int(slots[-1]) + 1]
                kept = self._kept(logits_to_keep, seq - begin, len(slots))
                logits.append(self._chunk(input_ids[:, begin : begin + PREFILL_CHUNK], mask, cache, slots, kept))
            logits = torch.cat(logits, dim=1)
        return logits[:, -logits_to_keep:] if logits_to_keep else logits

    def _kept(self, logits_to_keep: int, left: int, chunk: int) -> int:
        """The logits_to_keep a chunk's run is fed when the last `logits_to_keep` of the input are asked for and
        `left` positions remain from this chunk on: 0 (the default, every position) where all of the chunk's are
        asked for, as in a decode step, else the ones asked for, and one (to be dropped) where none is."""
        if not logits_to_keep or not self.artifact.keeps_logits:
            return 0
        wanted = logits_to_keep - (left - chunk)  # how many of this chunk's positions are asked for
        return 0 if wanted >= chunk else max(wanted, 1)

    def _chunk(self, input_ids, attention_mask, cache: GatedCache, cache_position, kept: int = 0) -> torch.Tensor:
        """One run over a chunk, or one per row where GroupQueryAttention takes the chunk for one row only (it
        follows cached positions); returns its logits `[batch, seq or kept, vocab]`."""
        batch, seq = input_ids.shape
        pasts = self._layers(cache, batch)
        by_row = self.artifact.attention == "gqa" and batch > 1 and seq > 1 and int(cache_position[0]) > 0
        if not by_row:
            logits, presents = self._run(input_ids, attention_mask, pasts, cache_position, kept)
            self._store(cache, presents, cache_position)
            return logits
        rows = [slice(row, row + 1) for row in range(batch)]
        runs = [
            self._run(input_ids[row], attention_mask[row], [{f: t[row] for f, t in layer.items()} for layer in pasts],
                      cache_position, kept)
            for row in rows
        ]  # fmt: skip
        joined = [
            {field: torch.cat([presents[index][field] for _, presents in runs]) for field in self.written_fields}
            for index in range(len(pasts))
        ]
        self._store(cache, joined, cache_position)
        return torch.cat([logits for logits, _ in runs])

    def _run(
        self, input_ids, attention_mask, pasts: list[dict], cache_position, kept: int = 0
    ) -> tuple[torch.Tensor, list[dict]]:
        """One session run (`kept` > 0: the graph's logits_to_keep); returns the logits and each layer's presents
        (in place: the past tensor itself)."""
        batch, seq = input_ids.shape
        binding = self.artifact.session.io_binding()
        bound = [
            self._bind(binding.bind_input, io.INPUT_IDS, input_ids),
            self._bind(binding.bind_input, io.ATTENTION_MASK, attention_mask),
        ]
        if self.static:
            bound.append(self._bind(binding.bind_input, io.CACHE_POSITION, cache_position))
        if kept:
            bound.append(self._bind(binding.bind_input, io.LOGITS_TO_KEEP, torch.tensor([kept])))
        logits = torch.empty(batch, kept or seq, self.config.vocab_size, dtype=torch.float32, device=self.device)
        self._bind(binding.bind_output, io.LOGITS, logits)
        presents = []
        for index, layer in enumerate(pasts):
            written = {}
            for field in self.fields:
                past = layer[field]
                in_place = field not in self.written_fields
                present = past if in_place else torch.empty(self._present_shape(past, field, seq), dtype=past.dtype,
                                                            device=self.device)  # fmt: skip
                bound.append(self._bind(binding.bind_input, io.PAST_TEMPLATE.format(layer=index, field=field), past))
                self._bind(binding.bind_output, io.PRESENT_TEMPLATE.format(layer=index, field=field), present)
                written[field] = present
            presents.append(written)
        self.artifact.session.run_with_iobinding(binding)
        return logits, presents

    def _bind(self, bind, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Bind `tensor` (moved to the session's device, contiguous) by address; return what was bound, which
        must live until the run."""
        tensor = tensor.to(self.device).contiguous()
        device = "cuda" if tensor.is_cuda else "cpu"
        bind(name, device, 0, element_type(CONTRACT_DTYPES[tensor.dtype]), list(tensor.shape), tensor.data_ptr())
        return tensor

    def _layers(self, cache: GatedCache, batch: int) -> list[dict[str, torch.Tensor]]:
        """Each layer's past tensors by contract field; an empty dynamic cache's are zero-length."""
        if cache.layers and cache.layers[0].keys is not None:
            return [{f: getattr(layer, ATTRIBUTES[f]) for f in self.fields} for layer in cache.layers]
        config, dtype = self.config, self.dtype
        empty = {
            "key": (config.kv_heads, 0, config.head_dim), "value": (config.kv_heads, 0, config.head_dim),
            "gate": (config.num_heads, 0), "key_shift": (config.kv_heads * config.head_dim,),
            "value_shift": (config.kv_heads * config.head_dim,),
        }  # fmt: skip
        return [
            {f: torch.zeros(batch, *empty[f], dtype=torch.float32 if f == "gate" else dtype, device=self.device)
             for f in self.fields}
            for _ in range(config.num_hidden_layers)
        ]  # fmt: skip

    @staticmethod
    def _present_shape(past: torch.Tensor, field: str, seq: int) -> tuple[int, ...]:
        if io.is_shift_state(field):
            return tuple(past.shape)
        return (*past.shape[:2], past.shape[2] + seq, *past.shape[3:])

    def _store(self, cache: GatedCache, presents: list[dict], cache_position: torch.Tensor) -> None:
        """Hand the step's presents to the cache: a static one was written in place but for its shift states,
        and records the slots written; a dynamic one holds the new tensors."""
        if self.static:
            for layer, written in zip(cache.layers, presents, strict=True):
                for field in self.fields:
                    if io.is_shift_state(field):
                        getattr(layer, ATTRIBUTES[field]).copy_(written[field])
                layer.written(cache_position)
            return
        cache.layers = [DynamicLayer.from_tensors(*(written.get(f) for f in ATTRIBUTES)) for written in presents]
