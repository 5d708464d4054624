"""The OpenAI-compatible gateway (`modelkeeper gateway`): routes each request to a ready
replica of its model.

* :mod:`gateway.app`: the ASGI application: auth, routing, retries, relaying answers and
  streams, and the answers given when nothing can serve.
* :mod:`gateway.table`: models and the live state of their replicas (in-flight counts,
  breakers), kept across updates from the store.
* :mod:`gateway.table_listener`: LISTENs for the store's notifications and re-reads the
  routes (and API keys) they name into the table.
* :mod:`gateway.breaker`: the per-replica circuit breaker.
* :mod:`gateway.responses`: OpenAI-shaped errors and the reasons a model can't be served.
* :mod:`gateway.metrics`: Prometheus metrics, summed over workers.
* :mod:`gateway.usage`: per-replica usage written to the store once per tick.
* :mod:`gateway.server`: uvicorn, one worker or several sharing the port.
* :mod:`gateway.keys_cli`: `modelkeeper keys create|ls|revoke`.

Its SQL lives in :mod:`modelkeeper.store.routing`.
"""
