"""Real farm parts that the tests and the benchmarks both start: a redis-server on a free port,
`renderfarm worker` processes, TLS certificates, a GCS emulator and the proxies that slow or break
the way to it or to Redis. Not part of the installed package; tests find it
from the repository root and bench/ runs with PYTHONPATH=."""
