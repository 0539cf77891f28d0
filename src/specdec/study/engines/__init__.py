"""The engines measured beside specdec's own loop: an OpenAI-compatible server over HTTP
(endpoint.py), stock llama.cpp's server and lookup tool, the "same kernels" twin and
ik_llama.cpp (anchors.py builds and starts them; peers.py: their modes and flags; ik_source.py:
ik_llama.cpp from an upstream tree), transformers' assisted generation (hf_assisted.py).
Imports the study's artifacts/ at most."""
