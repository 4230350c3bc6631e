"""The HTTP surface: the OpenAI API and the admin endpoints (``app``), the Prometheus
figures (``metrics``) and the live page (``dashboard/``). Nothing here decides where a
request goes: ``app`` hands each completion to the gateway's request path."""
