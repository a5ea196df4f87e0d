"""Control-plane plumbing shared by both services: gRPC servers/channels, auth, health."""
