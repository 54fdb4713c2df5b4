"""EAGLE-3 proposer (the role of vllm/v1/spec_decode/eagle.py): a one-layer head
(``pyengine.models.llama_eagle3``) drafts greedily from the target's hidden states of
three auxiliary layers.

Row ``p`` of the head reads the token at ``p + 1`` and the target's (fused) hidden state
at ``p``, and predicts the token at ``p + 2``. Per step, for every scheduled request, one
forward over its positions whose target states this step computed and whose next token
is known (all fed positions of a prefill chunk; for a sampling request the accepted
ones, the newest token last), which writes the head's KV (its own cache in the target's
blocks) and gives the first draft; then ``k - 1`` one-row forwards feeding the previous
draft with the head's own previous output as hidden state. Runs on every step (one
layer), also where ``disable_by_batch_size`` leaves the drafts out, so its KV stays
whole. The target keeps its auxiliary states only while this proposer needs them; its
decode steps run eagerly (no CUDA graphs).

Tensor parallelism: the head is sharded on the target's group (the target's auxiliary
states are the summed residual stream, the same on every rank); rank 0 decides each
step's forwards (a ``DraftPlan``), sends them, and every rank runs them."""
from __future__ import annotations

import numpy as np
import torch

from pyengine.spec_decode.base import DraftPlan, Proposer, draft_attn_metadata, drafts_by_depth, kv_bytes, num_drafts_wanted

__all__ = ["Eagle3Proposer"]


class Eagle3Proposer(Proposer):
    """``Eagle3Proposer(config, runner)``: loads ``config.speculative_config.model`` and
    sets the runner's target model to keep its auxiliary hidden states. Raises ValueError
    for a target that is not a Llama-family decoder."""

    allows_cuda_graphs = False

    def __init__(self, config, runner):
        from pyengine.attention.backend import get_backend_cls
        from pyengine.models.llama import DecoderModel
        from pyengine.models.llama_eagle3 import Eagle3LlamaForCausalLM, default_aux_layers
        from pyengine.models.loader import build_model, iterate_weights, load_weights
        from pyengine.models.registry import model_dims

        self.spec = spec = config.speculative_config
        self.config, self.block_size, self.device = config, config.block_size, config.device
        cfg = spec.draft_hf_config
        target = getattr(runner.model, "model", None)
        if not isinstance(target, DecoderModel):
            raise ValueError(f"speculative_config: EAGLE-3 needs a Llama-family target, got {type(runner.model).__name__}")
        target_h = getattr(cfg, "target_hidden_size", None) or cfg.hidden_size
        if target_h != config.hf_config.hidden_size:
            raise ValueError(f"speculative_config: the EAGLE-3 head reads hidden states of size {target_h}, the target's "
                             f"are {config.hf_config.hidden_size}")
        target.aux_hidden_state_layers = default_aux_layers(cfg, len(target.layers))
        self.target = target
        tp = runner.tp
        self.dims = d = model_dims(cfg, tp.world_size if tp is not None else 1)
        self.attn = get_backend_cls(config.attention_backend)(d.num_heads, d.num_kv_heads, d.head_dim,
                                                              d.head_dim ** -0.5, config.block_size, config.dtype,
                                                              config.device)
        names = {n for n, _ in iterate_weights(spec.model)}
        has_embed = any(n.endswith("embed_tokens.weight") for n in names)
        self.model = build_model(lambda: Eagle3LlamaForCausalLM(cfg, self.attn, has_embed, tp), config.dtype,
                                 config.device, config.max_model_len)
        weights = Eagle3LlamaForCausalLM.checkpoint_names(iterate_weights(spec.model))
        if not any(n.endswith("d2t") for n in names):
            zeros = torch.zeros(self.model.draft_vocab_size, dtype=torch.int64)
            weights = [*weights, ("draft_id_to_target_id", zeros)]
        with torch.no_grad():
            load_weights(self.model, weights)
        if not has_embed:
            self.model.share_embedding(target.embed_tokens)
        self.model.eval()
        self.kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self) -> int:
        return kv_bytes(self.dims, self.block_size, self.config.dtype)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        d = self.dims
        self.kv_caches = [torch.zeros(2, num_blocks, self.block_size, d.num_kv_heads, d.head_dim,
                                      dtype=self.config.dtype, device=self.device)]
        self.model.bind_kv_caches(self.kv_caches)

    @torch.inference_mode()
    def propose(self, so, sampled, generated, hidden) -> list[list[int]]:
        if self.target.aux_hidden_states is None or not so.scheduled:
            self.target.aux_hidden_states = None
            return [[] for _ in sampled]
        gen = {id(s): g for s, g in zip(sampled, generated)}
        seqs, row_starts, want, active = [], [], [], []
        row = 0
        for s in so.scheduled:
            r, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            g = gen.get(id(s))
            if g is not None:
                ctx = r.all_token_ids + list(g)
                end = r.num_tokens + len(g)  # known tokens after this step
                c = end - 1 - start  # rows whose next token is known: up to the newest token's predecessor
                k = num_drafts_wanted(self.spec, so, s, len(g), self.config.max_model_len)
                k = max(0, min(k, len(s.block_ids) * self.block_size - (start + c) + 1))
            else:
                ctx = r.all_token_ids
                c = min(n, r.num_tokens - 1 - start)
                k = 0
            if c > 0:
                if k:
                    active.append((len(seqs), k))
                seqs.append((start, ctx[start + 1:start + 1 + c], s.block_ids))
                row_starts.append(row)
                want.append(s)
            row += n
        drafts: dict[int, list[int]] = {}
        if seqs:
            plan = DraftPlan(seqs, active, row_starts)
            if self.plan_sink is not None:
                self.plan_sink(plan)
            cols, out_rows = self._run(plan)
            if cols:
                for (i, _), t in drafts_by_depth(cols, out_rows):
                    drafts.setdefault(id(want[i]), []).append(t)
        self.target.aux_hidden_states = None
        return [drafts.get(id(s), []) for s in sampled]

    def follow(self, plan: DraftPlan) -> None:
        with torch.inference_mode():
            self._run(plan)
        self.target.aux_hidden_states = None

    def _run(self, plan: DraftPlan) -> tuple[list[torch.Tensor], list[list[tuple[int, int]]]]:
        """The forwards of ``plan`` over the target's auxiliary states of the step (every
        rank): (each depth's draft tokens int64 on the device, the ``plan.active`` entries
        they belong to); ([], []) without drafts."""
        aux = self.target.aux_hidden_states
        if aux is None:
            raise RuntimeError("EAGLE-3: the target kept no auxiliary hidden states for this step")
        ids, pos, meta = draft_attn_metadata(plan.seqs, self.block_size, self.device)
        qsl = meta.query_start_loc_cpu.numpy()
        lens = np.diff(qsl)
        # each request's rows of the target step: its row start, then consecutive
        rows = np.arange(int(qsl[-1])) + np.repeat(np.asarray(plan.row_starts, dtype=np.int64) - qsl[:-1], lens)
        h_in = self.model.combine_hidden_states(aux[torch.from_numpy(rows).to(self.device)])
        normed, pre = self.model(ids, pos, h_in, meta)
        active = plan.active
        if not active:
            return [], []
        last = torch.tensor([int(qsl[i + 1]) - 1 for i, _ in active], dtype=torch.int64).to(self.device)
        # each depth's tokens stay on the device and feed the next depth; one copy at the end
        tok = self.model.compute_draft_tokens(normed[last])
        h = pre[last]
        cols, out_rows = [tok], [active]
        for j in range(1, max(k for _, k in active)):
            keep = [a for a, (_, k) in enumerate(active) if k > j]
            if not keep:
                break
            if len(keep) < len(active):
                idx = torch.tensor(keep, dtype=torch.int64).to(self.device)
                h, tok = h[idx], tok[idx]
                active = [active[a] for a in keep]
            ids, pos, meta = draft_attn_metadata(plan.depth_batch(active, j), self.block_size, self.device,
                                                 token_ids=tok)
            normed, h = self.model(ids, pos, h, meta)
            tok = self.model.compute_draft_tokens(normed)
            cols.append(tok)
            out_rows.append(active)
        return cols, out_rows
