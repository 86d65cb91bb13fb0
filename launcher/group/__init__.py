"""The process group and its helpers: the one way to start and end a group (``rendezvous``), a rank's collectives
that also work without one (``helpers``), the abort signal of a rank's collectives (``abort``), the one place that
turns torch's errors of a failed collective into ours (``failed``), and which rank is stuck after a collective timed
out (``stall``)."""
