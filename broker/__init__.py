"""Corral broker: reliable request-reply over ZeroMQ, and the wire protocol."""
