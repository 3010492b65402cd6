"""What runs on the node, in the job: the segment runner (``runner``), shipped there with the
rules it applies, and run by every backend's batch script. It imports the standard library
and those rules alone: a node needs a ``python3``, not chainrun."""
