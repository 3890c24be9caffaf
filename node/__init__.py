"""Runtime shared by the prefill and decode node processes: options, control socket, heartbeats, logs."""
