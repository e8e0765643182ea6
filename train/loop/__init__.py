"""The RL loop: the controller and its collaborators (executors, scoring, experience, DAPO's
batch filling)."""
