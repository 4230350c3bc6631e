"""The replica's public contract: what the router, the load tests and foreign engines share.

Everything a component outside ``replica/`` may know of a replica lives here, in one
module per concept, and nothing here imports the engine:

- ``identity``: block identities (the chained xxh3 over token ids), the default model
  name that seeds them and the default block size;
- ``tokenizer``: the simulated tokenizer and its prefix-stable chat template;
- ``model_tokenizer``: a real model's (Hugging Face ``tokenizer.json``, Jinja template);
- ``kv_events``: the KV-event types a replica publishes, with their one encoder and
  decoder; ``kv_wire``: the same events in vLLM's ZMQ wire format (msgpack);
- ``config`` and ``stats``: a replica's configuration and its typed ``/stats``;
- ``openai``: the OpenAI request models, response shapes and error bodies;
- ``cost_model``: what an engine's step costs (a profile, built in or calibrated), read
  by the engine to time its steps and by the router to price a request's first token.

``router/`` and ``loadtest/`` import nothing else of ``replica/`` (the offline
replayer drives ``replica.engine`` itself); the import contracts in
``pyproject.toml`` keep it so.
"""
