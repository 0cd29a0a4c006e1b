"""An independent, deliberately plain implementation of the Deriv equations, for parity tests.

It reads only the weights (a state dict) and the config, loops over heads one by one, builds its own
sinusoid with Python's math module and its own causal mask, and shares no code with the package.
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


def reference_logits(state: dict, config, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits (T, V) for one unpadded sequence, computed in float64 from the equations."""
    sd = {k: v.double() for k, v in state.items()}
    d, h, T = config.hidden_size, config.num_attention_heads, input_ids.shape[0]
    d_k = d // h
    act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu}[config.hidden_act]
    emb = sd["model.embed_tokens.weight"]
    x = emb[input_ids] * math.sqrt(d) + sinusoid(config.max_position_embeddings, d)[:T]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."

        def lin(name, v, p=p):
            return v @ sd[p + name + ".weight"].T + sd[p + name + ".bias"]

        def ln(name, v, p=p):
            return layer_norm(v, sd[p + name + ".weight"], sd[p + name + ".bias"], config.layer_norm_eps)

        def attention(v):
            q, k, val = lin("self_attn.q_proj", v), lin("self_attn.k_proj", v), lin("self_attn.v_proj", v)
            heads = []
            for i in range(h):
                qi, ki, vi = (t[:, i * d_k : (i + 1) * d_k] for t in (q, k, val))
                scores = qi @ ki.T / math.sqrt(d_k)
                for row in range(T):
                    scores[row, row + 1 :] = -math.inf  # position t sees positions <= t
                heads.append(torch.softmax(scores, dim=-1) @ vi)
            return lin("self_attn.o_proj", torch.cat(heads, dim=-1))

        def ffn(v):
            return lin("mlp.fc2", act(lin("mlp.fc1", v)))

        if config.pre_norm:
            x = x + attention(ln("self_attn_layer_norm", x))
            x = x + ffn(ln("final_layer_norm", x))
        else:
            x = ln("self_attn_layer_norm", x + attention(x))
            x = ln("final_layer_norm", x + ffn(x))
    if config.pre_norm:
        x = layer_norm(x, sd["model.norm.weight"], sd["model.norm.bias"], config.layer_norm_eps)
    return x @ emb.T
