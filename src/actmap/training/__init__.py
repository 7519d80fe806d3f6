"""The paper's training recipe, its epoch checkpoints, and the run folder a detector is trained into."""
