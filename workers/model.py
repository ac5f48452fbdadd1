"""Our own Llama-family forward (RMSNorm, RoPE, GQA, SwiGLU). Attention is delegated to an `AttentionFn`;
the layer layout and its Hugging Face names are `workers/layer_weights.py`.

The engine flattens the tokens of every sequence in a step into one batch of T rows and passes an
`AttentionFn` that owns the KV cache (it writes k/v and runs prefill/decode attention per layer).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import torch
import torch.nn.functional as F

from chunkserve.workers.config import ModelConfig
from chunkserve.workers.dense_attention import DenseCausalAttention
from chunkserve.workers.glue import glue_for, glued_layers
from chunkserve.workers.layer_weights import LayerWeights, Weight, layers_from_hf, layers_to_hf, random_layers
from chunkserve.workers.linear import (
    QUANT_MODES,
    Int8Weight,
    LinearFn,
    int8_linear,
    onednn_packing_available,
    pack_weight,
    packed_linear,
    packing_matches_f_linear,
    plain_linear,
)
from chunkserve.workers.quant import BlockWeight, Q4Weight, Q8Weight, block_linear
from chunkserve.workers.rope import rope_inv_freq
from chunkserve.workers.step_program import BF16_PROGRAM_ROWS, StepPrograms

__all__ = ["AttentionFn", "CausalLM", "DenseCausalAttention", "LayerWeights", "Weight", "rope_inv_freq"]


class AttentionFn(Protocol):
    """Per-layer attention over the step's T rows; q and k arrive with RoPE applied."""

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D] -> o: [T, Hq, D]
        ...


class CausalLM:
    """A Llama-family decoder over flattened tokens. Build with `from_state_dict` or `random`."""

    def __init__(self, config: ModelConfig, embed: torch.Tensor, layers: list[LayerWeights],
                 norm: torch.Tensor, lm_head: Weight) -> None:
        self.config = config
        self.embed = embed  # [V, H]
        self.layers = layers
        self.norm = norm  # [H]
        self.lm_head = lm_head  # [V, H]; the same tensor as embed when tied (until quantised)
        self.dtype = embed.dtype
        self.device = embed.device
        self.quantization: str | None = None
        inv_freq, scale = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2] fp32
        cos = (freqs.cos() * scale).to(device=self.device, dtype=self.dtype)  # [P, D/2]
        sin = (freqs.sin() * scale).to(device=self.device, dtype=self.dtype)  # [P, D/2]
        # full-width tables, so a step's RoPE factors are two index_selects: rope(x) = x * cos +
        # swap_halves(x) * sin, i.e. transformers' rotate-half with -sin folded in
        self._cos = torch.cat((cos, cos), -1).unsqueeze(1)  # [P, 1, D]
        self._sin = torch.cat((-sin, sin), -1).unsqueeze(1)  # [P, 1, D]
        # 0-dim fp32 constants of the RMSNorm: hidden size and epsilon
        self._width = torch.tensor(float(config.hidden_size), device=self.device)
        self._eps = torch.tensor(config.rms_norm_eps, dtype=torch.float32, device=self.device)
        self._packed: list[tuple[torch.Tensor | None, ...]] | None = None  # oneDNN-blocked weights (prepack)
        self._packed_head: torch.Tensor | None = None
        self._batch_hint = 32
        # per layer (qkv, o, gate_up, down), for one row on one thread and otherwise: LinearFns, or f(x, h, rope=...)
        self._fns_row: list[tuple[Callable[..., torch.Tensor], ...]] = []
        self._fns_rows: list[tuple[Callable[..., torch.Tensor], ...]] = []
        self._head: LinearFn = plain_linear(embed, None)
        self._fused = False  # the bound matmuls carry the norms, SwiGLU and residual adds (block-quantised)
        self._programs: StepPrograms | None = None  # with them: decode steps' layer loops as one call
        self._bf16_programs: StepPrograms | None = None  # bf16 (prepacked): one-row decode steps as one call
        self.step_programs = True  # off: the Python layer loop (the same calls; benchmarks time them apart)
        self._glue = glue_for(embed)  # dense CPU layers: norms, RoPE, SwiGLU in one call each (`workers/glue.py`)
        self.glue_layers = True  # off: the same layers in ATen ops (benchmarks time them apart)
        self._bind()

    def _linear_fns(self, w: Weight, b: torch.Tensor | None, packed: torch.Tensor | None) -> tuple[LinearFn, LinearFn]:
        """(one-row-one-thread, general) matmul of one weight: int8 as is; dense through oneDNN when packed,
        except one fp32 row on one thread, where MKL's GEMV beats the blocked kernel (~10% on the layers of
        SmolLM2 on an AVX2 EPYC; on two threads oneDNN wins; bf16 F.linear would re-pack the weight)."""
        if isinstance(w, Int8Weight):
            fn = int8_linear(w, b, self.dtype)
            return fn, fn
        if isinstance(w, BlockWeight):
            fn = block_linear(w, b, self.dtype)
            return fn, fn
        if packed is None:
            fn = plain_linear(w, b)
            return fn, fn
        rows = packed_linear(packed, b)
        return (plain_linear(w, b) if self.dtype == torch.float32 else rows), rows

    def _bind(self) -> None:
        """Rebuild the bound matmuls after the weights or their packed copies change."""
        c = self.config
        # block-quantised layers (with the kernel): each matmul call carries its norm, SwiGLU, residual add
        self._programs = StepPrograms.bind(self.layers, c.rms_norm_eps, c.hidden_size,
                                           (c.num_heads, c.num_kv_heads, c.head_dim), self.dtype)
        self._fns_row, self._fns_rows, self._fused = [], [], self._programs is not None
        if self._programs is not None:
            self._fns_row = self._fns_rows = list(self._programs.fns)
        for i, lw in enumerate(self.layers if self._programs is None else ()):
            pk = self._packed[i] if self._packed is not None else (None, None, None, None)
            pairs = [self._linear_fns(w, b, p) for (w, b), p in zip(lw.matmuls(), pk, strict=True)]
            self._fns_row.append(tuple(p[0] for p in pairs))
            self._fns_rows.append(tuple(p[1] for p in pairs))
        self._norms = [*(ln for lw in self.layers for ln in (lw.ln1, lw.ln2)), self.norm]  # as `glued_layers` takes
        if isinstance(self.lm_head, BlockWeight):  # fp32 logits straight from the kernel
            self._head = block_linear(self.lm_head, None, self.dtype, torch.float32)
        else:
            self._head = self._linear_fns(self.lm_head, None, self._packed_head)[1]  # as fast or faster there
        if self._programs is not None:  # the layers' and the head's block weights in one stream
            self._programs.gather(self._head)

    def prepack(self, batch_hint: int = 32) -> bool:
        """Reorder the dense matmul weights once into oneDNN's blocked layout (CPU fp32/bf16); returns whether.

        Plain `F.linear` re-packs the weight on every call; the packed form skips that (about 1.3x
        faster decode matmuls in bf16, 1.4x in fp32 at 2+ rows, lm_head 1.7x). bf16 results are
        bit-identical; fp32 ones differ from MKL's in the last bits (another summation order), like any
        other blocking. One fp32 row on one thread goes through MKL's GEMV (faster there). Costs one
        extra copy of the dense weights in memory (bf16 with AVX512-BF16: two, the second for decode steps of
        few rows, `StepPrograms.bind_bf16`); int8 weights are not packed.
        """
        if self._packed is not None:
            return True
        if not onednn_packing_available(self.dtype, self.device):
            return False
        try:
            if not packing_matches_f_linear(self.dtype, batch_hint):
                return False

            def pack(w: Weight) -> torch.Tensor | None:
                return pack_weight(w, batch_hint) if isinstance(w, torch.Tensor) else None

            self._packed = [tuple(pack(w) for w, _ in lw.matmuls()) for lw in self.layers]
            self._packed_head = pack(self.lm_head)
        except RuntimeError:  # an ATen build without these oneDNN ops
            self._packed = self._packed_head = None
            return False
        self._batch_hint = batch_hint
        if self.dtype == torch.bfloat16:  # with AVX512-BF16: decode steps of few rows at memory speed
            c = self.config
            self._bf16_programs = StepPrograms.bind_bf16(self.layers, self.lm_head, c.rms_norm_eps, c.hidden_size,
                                                         (c.num_heads, c.num_kv_heads, c.head_dim))
        self._bind()
        return True

    def quantize(self, mode: str, *, lm_head: bool | None = None) -> None:
        """Quantise every layer's linears and, unless ``lm_head=False``, the lm_head.

        Both modes store llama.cpp's block formats (`workers/quant.py`: blocks of 32 along K, the
        activations quantised to int8 per block inside the matmul): "int8" as Q8_0 (int8 values, one fp16
        scale per block) and "int4" as Q4_1 layers with a Q8_0 lm_head. The embedded SmolLM2 GGUF is
        Q4_1/Q8_0, so int4 re-creates its weights. Where some input size is not a multiple of 32, "int8"
        falls back to weight-only per-output-channel int8 (`Int8Weight`, ATen's ``_weight_int8pack_mm``;
        its lm_head stays dense by default) and "int4" is refused. The embedding table stays dense (a tied
        lm_head gets its own quantised copy); norms and biases stay in the model dtype. The dense matmul
        weights (and their packed copies) are released.
        """
        if mode not in QUANT_MODES:
            raise ValueError(f"unsupported quantization {mode!r}; expected one of {QUANT_MODES} or None")
        if self.quantization is not None:
            raise ValueError(f"the model is already quantised ({self.quantization})")
        blocks = all(w.shape[1] % 32 == 0 for lw in self.layers for w, _ in lw.matmuls())
        if mode == "int4" and not blocks:
            raise ValueError("int4 quantisation needs every linear's input size to be a multiple of 32")
        block_cls: type[Q4Weight] | type[Q8Weight] = Q4Weight if mode == "int4" else Q8Weight

        def q(w: Weight) -> Weight:
            if not isinstance(w, torch.Tensor):
                return w
            return block_cls.quantize(w) if blocks else Int8Weight.quantize(w)

        self.layers = [LayerWeights(
            ln1=lw.ln1, w_qkv=q(lw.w_qkv), b_qkv=lw.b_qkv, w_o=q(lw.w_o), b_o=lw.b_o, ln2=lw.ln2,
            w_gate_up=q(lw.w_gate_up), b_gate_up=lw.b_gate_up, w_down=q(lw.w_down), b_down=lw.b_down,
        ) for lw in self.layers]
        if lm_head is None:
            lm_head = blocks  # a per-channel int8 head is slower at batch 32 and costs agreement (bench_quant)
        if lm_head and isinstance(self.lm_head, torch.Tensor):
            if blocks:
                self.lm_head = Q8Weight.quantize(self.lm_head)
            else:
                self.lm_head = q(self.lm_head)
        self.quantization = mode
        repack = self._packed is not None
        self._packed = self._packed_head = self._bf16_programs = None  # the copies go with the dense weights
        # re-packing keeps a packed copy of what is still dense (the lm_head) and rebinds
        if not (repack and self.prepack(self._batch_hint)):
            self._bind()

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers, in the model dtype."""
        c = self.config
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * self.embed.element_size()

    @classmethod
    def from_state_dict(cls, config: ModelConfig, sd: Mapping[str, torch.Tensor], *,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> CausalLM:
        """From Hugging Face names (`model.layers.{i}.self_attn.q_proj.weight`, ...); fuses at load time."""
        return cls(config, *layers_from_hf(config, sd, dtype, device))

    @classmethod
    def random(cls, config: ModelConfig, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0, std: float = 0.02) -> CausalLM:
        """Random weights (normal(0, std), norms = 1) generated directly on the device."""
        return cls(config, *random_layers(config, dtype, device, seed, std))

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face names (unfused), e.g. to save a random model with `save_checkpoint`.

        Quantised weights come back dequantised (in the model dtype): the values this model computes with."""
        return layers_to_hf(self.config, (self.embed, self.layers, self.norm, self.lm_head), self._dense)

    def _dense(self, w: Weight) -> torch.Tensor:
        return w if isinstance(w, torch.Tensor) else w.dequantize(self.dtype)

    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # x: [T, H] -> [T, H]: transformers' formula (fp32 statistics, cast back to x's dtype *before* the
        # weight multiply), bit for bit, in 7 plain ops: F.rms_norm dispatches ~24, the 0-dim constants
        # spare two scalar-to-tensor copies per call (small ops cost far more between large matmuls
        # than in a micro-benchmark: their code and data are out of cache)
        xf = x if x.dtype == torch.float32 else x.float()
        inv = torch.mul(xf, xf).sum(-1, keepdim=True).div_(self._width).add_(self._eps).rsqrt_()  # [T, 1]
        y = torch.mul(xf, inv)
        return (y if y.dtype == x.dtype else y.to(x.dtype)).mul_(w)

    def rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-step RoPE factors for `positions` [T]: (cos [T, 1, D], signed sin [T, 1, D]) such that
        rope(x) = x * cos + swap_halves(x) * sin, i.e. transformers' rotate-half with -sin folded in."""
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionFn,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Run all layers over T flattened tokens; returns the final-normed hidden states [T, H], or only the
        rows ``keep`` ([n] indices, in that order) when given. With block-quantised layers (row-invariant calls)
        the last layer then runs its o-projection and MLP on those rows alone: every row's K and V are written
        before, and no later layer reads the others (a step that samples nothing skips them entirely).

        Positions are range-checked when they are on the CPU (no device sync otherwise; an out-of-range
        index then fails inside index_select). Everything per step (RoPE factors, the matmul set for
        this T) is prepared once, so the layer loop holds no host syncs and ~20 small calls per layer."""
        c = self.config
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(f"input_ids and positions must both be 1-D [T]; got {tuple(input_ids.shape)} "
                             f"and {tuple(positions.shape)}")
        t = input_ids.shape[0]
        if t and positions.device.type == "cpu" and int(positions.max()) >= c.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} exceeds max_position_embeddings "
                             f"{c.max_position_embeddings}")
        input_ids = input_ids.to(self.device)
        progs = self._programs or (self._bf16_programs if t <= BF16_PROGRAM_ROWS else None)
        if progs is not None and self.step_programs:
            h = progs.forward(attn, self.embed, self._cos, self._sin, input_ids, positions)
            if h is not None:  # a decode step, every layer in one call (`workers/step_program.py`)
                return self._rms_norm(h if keep is None else h.index_select(0, keep), self.norm)
        cos, sin = self.rope_tables(positions.to(self.device))  # [T, 1, D] each
        hq, hkv, d = c.num_heads, c.num_kv_heads, c.head_dim
        half, qk_size, q_size = d // 2, c.q_size + c.kv_size, c.q_size
        h = self.embed.index_select(0, input_ids)  # [T, H], our own buffer: residual adds go in place
        fns = self._fns_row if t == 1 and torch.get_num_threads() == 1 else self._fns_rows
        if self._fused:  # norms, SwiGLU and residual adds inside the kernel's calls: 4 calls + RoPE per layer
            rope = (cos, sin, qk_size)  # [T, 1, D] each: contiguous [T, D]
            last = len(fns) - 1
            for i, (f_qkv, f_o, f_gate_up, f_down) in enumerate(fns):
                # [T, (Hq + 2*Hkv) * D]: RMSNorm(ln1) on the way in, RoPE on the q and k heads on the way out
                qkv = f_qkv(h, rope=rope).view(t, hq + 2 * hkv, d)
                o = attn(i, qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]).reshape(t, q_size)  # [T, Hq * D]
                if i == last and keep is not None:  # the rows that sample: [n, Hq * D] and [n, H]
                    o, h = o.index_select(0, keep), h.index_select(0, keep)
                f_o(o, h)  # h += o . W_o^T
                f_down(f_gate_up(h), h)  # h += SwiGLU(RMSNorm(h) . W_gu^T) . W_down^T
            return self._rms_norm(h, self.norm)
        if self._glue is not None and self.glue_layers:
            h = glued_layers(self._glue, h, self._norms, c.rms_norm_eps, fns, cos, sin, (hq, hkv, d), attn)
            return h if keep is None else h.index_select(0, keep)
        for i, (lw, (f_qkv, f_o, f_gate_up, f_down)) in enumerate(zip(self.layers, fns, strict=True)):
            qkv = f_qkv(self._rms_norm(h, lw.ln1))  # [T, (Hq + 2*Hkv) * D]
            qk = qkv[:, :qk_size].view(t, hq + hkv, d)  # q and k heads, RoPE'd in one go
            rot = torch.cat((qk[..., half:], qk[..., :half]), -1).mul_(sin).addcmul_(qk, cos)  # [T, Hq+Hkv, D]
            # q: [T, Hq, D], k: [T, Hkv, D], v: [T, Hkv, D] (strided views)
            o = attn(i, rot[:, :hq], rot[:, hq:], qkv[:, qk_size:].view(t, hkv, d))  # [T, Hq, D]
            h.add_(f_o(o.reshape(t, q_size)))
            gate, up = f_gate_up(self._rms_norm(h, lw.ln2)).chunk(2, dim=-1)  # views [T, I] x2
            h.add_(f_down(F.silu(gate, inplace=True).mul_(up)))
        return self._rms_norm(h if keep is None else h.index_select(0, keep), self.norm)

    __call__ = forward

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, H] (from `forward`) -> fp32 logits [n, V]."""
        if (progs := self._bf16_programs) and progs.head and hidden.shape[0] <= BF16_PROGRAM_ROWS and self.step_programs:
            return progs.head(hidden)  # bf16 weights at memory speed, fp32 logits
        return self._head(hidden).float()
