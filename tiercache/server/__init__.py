"""The gRPC server: the servicer, RPC plumbing, leases of the same-host path, tenants and tokens, metrics.

The top of the server side: it imports `store`, `prefix`, `protocol`, `record`, `config`, `errors`;
nothing below imports it."""
