"""The explorer: `deriv explore FOLDER`, a local web page that shows one Deriv folder at work on a text.

It splits the text into the folder's BPE tokens (and shows the merges that built each one), shows the token
vectors, the positional encoding and their sum, every layer's and head's attention, the next token's
distribution under temperature, top-k, top-p and the presence and frequency penalties, and a few generation
steps with the KV cache's size. Every number is computed server-side by the model's own code paths
(`compute.py`: eager attention with `output_attentions`, transformers' logits processors, `generate()` and
its cache); `app.py` serves them as JSON to three static files (`static/`) that only draw them.
"""
