"""The floor every service stands on: gRPC server set-up, TLS, tracing, the service error type and where
models live on disk. Imports no torch, no model code and nothing of Tandem's above it."""
