"""The export pipeline: `kvg-export`, its options, the stages (the torch half lowered in a process of its own,
then checks, quantization and the artifact written whole or not at all) and their progress lines."""
