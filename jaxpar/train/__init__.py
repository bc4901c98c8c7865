"""Training: the jitted step (:mod:`.step`) and the loop around it (:mod:`.loop`)."""
