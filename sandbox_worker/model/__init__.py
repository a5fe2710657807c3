"""Model calls of the sandbox worker: the ``model`` service.

Layers, each ignorant of the one above:

- ``sse``: incremental Server-Sent Events parsing (bounded).
- ``items``: neutral (Responses-style) items to each provider's request body.
- ``streams``: each provider's stream events / JSON reply to neutral deltas
  and one ``ModelCallResult``.
- ``errors``: the exception tree, and the one boundary translating httpx
  errors and HTTP statuses into it.
- ``pool``: the sharded httpx transports; proxies from the environment.
- ``http``: one HTTP attempt over them.
- ``relay``: coalescing deltas into ordered PARTIALs.
- ``secrets``: credentials from the worker's environment; log redaction.
- ``service``: the broker handler, retries within the request's budget.
"""
