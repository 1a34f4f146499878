"""The paper's encoder: a post-LN BERT-style transformer, as a classifier or a masked LM.

Paper size (``preset="paper"``): six encoders, d 768, 12 heads, FFN 3072, GELU, sequence
128, learned positions and token types, a TTM word embedding (rows ``[16,20,10,10]``,
columns ``[4,4,8,6]``, rank 32) and TT encoder linears (attention ``[12,8,8 | 8,8,12]``,
FFN ``[12,8,8 | 12,16,16]`` and ``[16,16,12 | 8,8,12]``, rank 30). ``small`` and ``tiny``
shrink the width (and ``tiny`` the depth) for quick runs; their factors are chosen
automatically.

Which layers are TT is set by the layer kinds in ``LayerFactory.tt_kinds``:
``embedding`` (word table), ``attention`` (q, k, v, o), ``ffn`` (both FFN linears),
``head`` (pooler / MLM transform). Positions, token types, LayerNorms and the final
classifier stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from comera_engine.errors import ConfigError
from comera_engine.models.common import LayerFactory, embedding

BERT_VOCAB = 30522


@dataclass(frozen=True)
class TransformerSize:
    """Shape of the encoder stack and its TT factorisations (``None``: automatic)."""

    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    rank: int
    embedding_rank: int
    dropout: float = 0.1
    attn_factors: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    ffn_in_factors: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    ffn_out_factors: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    vocab_factors: tuple[int, ...] | None = None  # used for the BERT vocabulary only
    dim_factors: tuple[int, ...] | None = None


PRESETS: dict[str, TransformerSize] = {
    "paper": TransformerSize(
        d_model=768,
        n_layers=6,
        n_heads=12,
        d_ff=3072,
        rank=30,
        embedding_rank=32,
        attn_factors=((12, 8, 8), (8, 8, 12)),
        ffn_in_factors=((12, 8, 8), (12, 16, 16)),
        ffn_out_factors=((16, 16, 12), (8, 8, 12)),
        vocab_factors=(16, 20, 10, 10),
        dim_factors=(4, 4, 8, 6),
    ),
    "small": TransformerSize(
        d_model=256, n_layers=6, n_heads=4, d_ff=1024, rank=16, embedding_rank=16
    ),
    "tiny": TransformerSize(
        d_model=64, n_layers=2, n_heads=2, d_ff=128, rank=8, embedding_rank=8, dropout=0.1
    ),
}


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q, k, v, o projections."""

    def __init__(self, size: TransformerSize, factory: LayerFactory) -> None:
        super().__init__()
        d, f = size.d_model, size.attn_factors or (None, None)
        self.n_heads = size.n_heads
        self.dropout = size.dropout
        self.q = factory.linear("attention", d, d, in_factors=f[0], out_factors=f[1])
        self.k = factory.linear("attention", d, d, in_factors=f[0], out_factors=f[1])
        self.v = factory.linear("attention", d, d, in_factors=f[0], out_factors=f[1])
        self.o = factory.linear("attention", d, d, in_factors=f[0], out_factors=f[1])

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, L, d]; ``keep`` [B, 1, 1, L] bool (True: attend to that key)."""
        b, n, _ = x.shape
        h = self.n_heads

        def heads(t: torch.Tensor) -> torch.Tensor:
            # the projection's own width (d, unless a pruned model narrowed the heads)
            return t.view(b, n, h, t.shape[-1] // h).transpose(1, 2)  # [B, H, L, d/H]

        y = F.scaled_dot_product_attention(
            heads(self.q(x)),
            heads(self.k(x)),
            heads(self.v(x)),
            attn_mask=keep,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.o(y.transpose(1, 2).reshape(b, n, -1))


class EncoderLayer(nn.Module):
    """Post-LN block: ``x = LN(x + Attn(x)); x = LN(x + FFN(x))``."""

    def __init__(self, size: TransformerSize, factory: LayerFactory) -> None:
        super().__init__()
        d, ff = size.d_model, size.d_ff
        fi, fo = size.ffn_in_factors or (None, None), size.ffn_out_factors or (None, None)
        self.attn = SelfAttention(size, factory)
        self.ln1 = nn.LayerNorm(d)
        self.ffn_in = factory.linear("ffn", d, ff, in_factors=fi[0], out_factors=fi[1])
        self.ffn_out = factory.linear("ffn", ff, d, in_factors=fo[0], out_factors=fo[1])
        self.ln2 = nn.LayerNorm(d)
        self.drop = nn.Dropout(size.dropout)

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
        x = self.ln1(x + self.drop(self.attn(x, keep)))
        return self.ln2(x + self.drop(self.ffn_out(F.gelu(self.ffn_in(x)))))


class Encoder(nn.Module):
    """Embeddings (word + position + token type, LN, dropout) and the encoder stack."""

    def __init__(
        self,
        size: TransformerSize,
        factory: LayerFactory,
        vocab_size: int,
        max_len: int,
        pad_id: int | None,
    ) -> None:
        super().__init__()
        d = size.d_model
        use_paper_factors = vocab_size == BERT_VOCAB and size.vocab_factors is not None
        self.word = factory.embedding(
            "embedding",
            vocab_size,
            d,
            padding_idx=pad_id,
            vocab_factors=size.vocab_factors if use_paper_factors else None,
            dim_factors=size.dim_factors,
        )
        self.position = embedding(max_len, d)
        self.token_type = embedding(2, d)
        self.ln = nn.LayerNorm(d)
        self.drop = nn.Dropout(size.dropout)
        self.layers = nn.ModuleList(EncoderLayer(size, factory) for _ in range(size.n_layers))
        self.max_len = max_len

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [B, L] -> hidden states [B, L, d]."""
        n = input_ids.shape[1]
        if n > self.max_len:
            raise ValueError(f"input_ids: sequence length {n} exceeds max_len {self.max_len}")
        pos = torch.arange(n, device=input_ids.device)
        x = self.word(input_ids) + self.position(pos)[None]
        if token_type_ids is not None:
            x = x + self.token_type(token_type_ids)
        else:
            x = x + self.token_type.weight[0]
        x = self.drop(self.ln(x))
        keep = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        for layer in self.layers:
            x = layer(x, keep)
        return x


class TransformerClassifier(nn.Module):
    """Encoder + BERT pooler (first token, dense, tanh) + linear classifier."""

    def __init__(
        self,
        size: TransformerSize,
        factory: LayerFactory,
        vocab_size: int,
        max_len: int,
        num_classes: int,
        pad_id: int | None = 0,
    ) -> None:
        super().__init__()
        self.size = size
        self.encoder = Encoder(size, factory, vocab_size, max_len, pad_id)
        self.pooler = factory.linear("head", size.d_model, size.d_model)
        self.drop = nn.Dropout(size.dropout)
        self.classifier = nn.Linear(size.d_model, num_classes)
        _init_dense(self)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [B, L] -> class logits [B, C]."""
        h = self.encoder(input_ids, token_type_ids, attention_mask)
        pooled = torch.tanh(self.pooler(h[:, 0]))
        return self.classifier(self.drop(pooled))


class TransformerMLM(nn.Module):
    """Encoder + MLM head (dense/TT transform, GELU, LN) with the decoder tied to the words.

    The decoder multiplies by the word table ``E`` [V, d] plus a bias; for a TTM table the
    hidden states are contracted with its cores (``TTEmbedding.decode``), so the
    ``V × d`` table is never built (dense-size memory every step otherwise).
    """

    def __init__(
        self,
        size: TransformerSize,
        factory: LayerFactory,
        vocab_size: int,
        max_len: int,
        pad_id: int | None = 0,
    ) -> None:
        super().__init__()
        self.size = size
        self.encoder = Encoder(size, factory, vocab_size, max_len, pad_id)
        self.transform = factory.linear("head", size.d_model, size.d_model)
        self.ln = nn.LayerNorm(size.d_model)
        self.decoder_bias = nn.Parameter(torch.zeros(vocab_size))
        _init_dense(self)

    def word_table(self) -> torch.Tensor:
        """The (tied) word embedding table [V, d]."""
        word = self.encoder.word
        return word.weight if isinstance(word, nn.Embedding) else word.dense_weight()

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        select: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [B, L] -> vocabulary logits [B, L, V], or [n, V] at ``select`` [B, L]."""
        h = self.encoder(input_ids, token_type_ids, attention_mask)
        if select is not None:
            h = h[select]
        h = self.ln(F.gelu(self.transform(h)))
        word = self.encoder.word
        if isinstance(word, nn.Embedding):
            scores = h @ word.weight.to(h.dtype).t()
        else:  # contract with the TT cores: no V x d table is built (ops/ttm_decode.py;
            scores = word.decode(h)  # a peer's tltorch table is rebuilt, layers/peers.py)
        return scores + self.decoder_bias.to(h.dtype)


def _init_dense(model: nn.Module) -> None:
    """BERT-style init: dense layers N(0, 0.02); the TT word table is scaled to the same
    entry std (its cores start with entries of variance 1, like ``nn.Embedding``); TT
    linears keep their ``nn.Linear``-like initialisation. A model on the meta device (a
    run plan's: shapes only) has nothing to initialise."""
    if any(p.is_meta for p in model.parameters()):
        return
    word = model.encoder.word  # type: ignore[union-attr]
    if not isinstance(word, nn.Embedding):  # TTEmbedding, or a peer's (tltorch) table
        cores = list(word.tt.cores) if hasattr(word, "tt") else word.factors()
        with torch.no_grad():
            for core in cores:
                core.mul_(0.02 ** (1.0 / len(cores)))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()


def resolve_size(preset: str, **overrides: float | int | None) -> TransformerSize:
    """A preset with the non-``None`` overrides applied (factors dropped if the width changes)."""
    base = PRESETS[preset]
    values = {k: v for k, v in overrides.items() if v is not None}
    if not values:
        return base
    fields = {**base.__dict__, **values}
    if fields["d_model"] != base.d_model or fields["d_ff"] != base.d_ff:
        for key in ("attn_factors", "ffn_in_factors", "ffn_out_factors", "dim_factors"):
            fields[key] = None
    if fields["d_model"] % fields["n_heads"]:
        raise ConfigError(
            "model.n_heads", f"must divide d_model={fields['d_model']}, got {fields['n_heads']}"
        )
    return TransformerSize(**fields)
