"""An independent, deliberately plain implementation of the Deriv equations, for parity tests.

It reads only the weights (a state dict) and the config, loops over heads one by one, builds its own
sinusoid and rotation with Python's math module and its own causal mask, and shares no code with the package.
The modern switches are written from their papers: rotary positions turn each pair (j, j + d_k/2) of a query
or key by pos / theta^(2j/d_k) (RoFormer, in the pairing Llama's checkpoints use), RMSNorm divides by the root
mean square, the gated feed-forward multiplies act(x W_g) into x W_1, and grouped-query head i reads key/value
head i // (h / h_kv). The speedrun's (issue 48) likewise: QK-norm divides each head's query and key rows by their
root mean square and multiplies by the gain, before the rotation (Qwen3); ReLU^2 is max(0, x)^2; the soft cap is
c tanh(z / c) on the logits; an untied head is `lm_head.weight` itself.
"""

import math

import torch


def sinusoid(num_positions: int, dim: int) -> torch.Tensor:
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    for pos in range(num_positions):
        for i in range(0, dim, 2):
            angle = pos / (10000 ** (i / dim))
            table[pos, i] = math.sin(angle)
            if i + 1 < dim:
                table[pos, i + 1] = math.cos(angle)
    return table


def layer_norm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def rms_norm(x, weight, eps):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + eps) * weight


def rotate(t: torch.Tensor, theta: float) -> torch.Tensor:
    """Each row pos of t (T, d_k) with its pairs (j, j + d_k/2) turned by the angle pos / theta^(2j/d_k)."""
    out = t.clone()
    half = t.shape[1] // 2
    for pos in range(t.shape[0]):
        for j in range(half):
            angle = pos / theta ** (2 * j / t.shape[1])
            c, s = math.cos(angle), math.sin(angle)
            a, b = t[pos, j].item(), t[pos, j + half].item()
            out[pos, j], out[pos, j + half] = a * c - b * s, a * s + b * c
    return out


def reference_logits(state: dict, config, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) for one unpadded sequence, computed in float64 from the equations."""
    sd = {k: v.double() for k, v in state.items()}
    d, h, T = config.hidden_size, config.num_attention_heads, input_ids.shape[0]
    d_k = d // h
    h_kv = getattr(config, "num_key_value_heads", None) or h
    rotary = config.position_embedding_type == "rotary"
    act = {
        "relu": torch.relu,
        "gelu": torch.nn.functional.gelu,
        "silu": torch.nn.functional.silu,
        "relu2": lambda v: torch.clamp(v, min=0) ** 2,
    }[config.hidden_act]
    emb = sd["model.embed_tokens.weight"]
    x = emb[input_ids] * (math.sqrt(d) if config.scale_embedding else 1.0)
    if not rotary:
        x = x + sinusoid(config.max_position_embeddings, d)[:T]

    def norm(v, prefix):
        if config.norm_type == "rms_norm":
            return rms_norm(v, sd[prefix + ".weight"], config.layer_norm_eps)
        bias = sd[prefix + ".bias"] if config.bias else 0.0  # a bias the model forgot is a KeyError here
        return layer_norm(v, sd[prefix + ".weight"], bias, config.layer_norm_eps)

    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."

        def lin(name, v, p=p):
            return v @ sd[p + name + ".weight"].T + (sd[p + name + ".bias"] if config.bias else 0.0)

        def ln(name, v, p=p):
            return norm(v, p + name)

        def attention(v, p=p):
            q, k, val = lin("self_attn.q_proj", v), lin("self_attn.k_proj", v), lin("self_attn.v_proj", v)
            heads = []
            for i in range(h):
                j = i // (h // h_kv)  # the key/value head query head i reads
                qi = q[:, i * d_k : (i + 1) * d_k]
                ki, vi = k[:, j * d_k : (j + 1) * d_k], val[:, j * d_k : (j + 1) * d_k]
                if getattr(config, "qk_norm", False):  # each row of this head: g * v / rms(v), then the rotation
                    qi = rms_norm(qi, sd[p + "self_attn.q_norm.weight"], config.layer_norm_eps)
                    ki = rms_norm(ki, sd[p + "self_attn.k_norm.weight"], config.layer_norm_eps)
                if rotary:
                    qi, ki = rotate(qi, config.rope_theta), rotate(ki, config.rope_theta)
                scores = qi @ ki.T / math.sqrt(d_k)
                for row in range(T):
                    scores[row, row + 1 :] = -math.inf  # position t sees positions <= t
                heads.append(torch.softmax(scores, dim=-1) @ vi)
            return lin("self_attn.o_proj", torch.cat(heads, dim=-1))

        def ffn(v):
            if config.gated_mlp:
                return lin("mlp.fc2", act(lin("mlp.gate", v)) * lin("mlp.fc1", v))
            return lin("mlp.fc2", act(lin("mlp.fc1", v)))

        if config.pre_norm:
            x = x + attention(ln("self_attn_layer_norm", x))
            x = x + ffn(ln("final_layer_norm", x))
        else:
            x = ln("self_attn_layer_norm", x + attention(x))
            x = ln("final_layer_norm", x + ffn(x))
    if config.pre_norm:
        x = norm(x, "model.norm")
    head = sd.get("lm_head.weight", emb)
    logits = (x @ head.T)[:, : config.vocab_size]
    cap = getattr(config, "final_logit_softcapping", None)
    return logits if cap is None else cap * torch.tanh(logits / cap)
