"""The peers of `python -m bench.peers`, each run by the interpreter of its own environment (tools/peers.sh), never
by the project's .venv: `python -m bench.peer_servers.pytriton_server` and `python -m bench.peer_servers.kserve_server`,
both serving server.py's own model code (model.py) under the Open Inference Protocol."""

PEER_HOST = "127.0.0.1"  # a local benchmark: nothing listens beyond loopback
