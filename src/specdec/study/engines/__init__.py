"""The engines measured beside specdec's own loop: an OpenAI-compatible server over HTTP
(endpoint.py), stock llama.cpp's server and lookup tool (anchors.py), transformers' assisted
generation (hf_assisted.py). Imports the study's artifacts/ at most."""
