"""The OpenAI-compatible gateway (`modelkeeper gateway`): routes each request to a ready
replica of its model.

* :mod:`gateway.app`: the ASGI application, a thin composition of the parts below, and
  the routes that are not completions (``/v1/models``, ``/metrics``, ``/healthz``).
* :mod:`gateway.admission`: client keys and their rates, reading and parsing the body,
  and the bounds on output per request.
* :mod:`gateway.routing`: the replica a request goes to, holding and retrying it, and
  :mod:`gateway.dispatch`, the pure rules for when the first pick finds nothing or fails.
* :mod:`gateway.forwarding`: engine keys, the connection pool, and one attempt on one
  replica.
* :mod:`gateway.streaming`: relaying an engine's answer, whole or event by event.
* :mod:`gateway.edge`: what every request must show first (Host, Content-Type, the
  ``/metrics`` token).
* :mod:`gateway.asgi`: the ASGI types and answer writers the parts share.
* :mod:`gateway.table`: models and the live state of their replicas (in-flight counts,
  breakers), kept across updates from the store.
* :mod:`gateway.table_listener`: LISTENs for the store's notifications and re-reads the
  routes (and API keys) they name into the table.
* :mod:`gateway.breaker`: the per-replica circuit breaker.
* :mod:`gateway.responses`: OpenAI-shaped errors and the reasons a model can't be served.
* :mod:`gateway.metrics`: Prometheus metrics, summed over workers.
* :mod:`gateway.usage`: per-replica usage written to the store once per tick, and what
  it (and each replica's metric series) hears of replicas entering and leaving routing.
* :mod:`gateway.engine_queue`: each routed engine's own queue (vLLM's
  ``vllm:num_requests_waiting``), scraped once per usage tick and written with its row.
* :mod:`gateway.server`: uvicorn, one worker or several sharing the port.
* :mod:`gateway.keys_cli`: `modelkeeper keys create|ls|revoke`.

Its SQL lives in :mod:`modelkeeper.store.routing`.
"""
