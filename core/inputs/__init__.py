"""Model inputs: what each graph input is for, and feeds made for that role.

One implementation for every caller (verification, benchmarks, passes): ``graph`` reads each input's role
from the graph (``analyze``), ``synthesize`` makes input sets for those roles with a ladder of guesses
(``InputSynthesis``, ``generate_input_sets``), ``specs`` lists the graph's inputs and reads the user's
samples.npz. Nothing here imports anything above ``core``.
"""

from core.inputs.graph import InputRole, ModelFacts, analyze
from core.inputs.specs import (
    RAW_SAMPLE_SETS,
    InputSet,
    InputSpec,
    cache_pairs,
    graph_inputs,
    load_raw_samples,
    load_samples,
)
from core.inputs.synthesize import (
    GUESSES,
    IGNORE_INDEX,
    InputSynthesis,
    generate_input_sets,
    index_ranges,
    make_input_sets,
    serving_input_set,
)

__all__ = [
    "GUESSES",
    "IGNORE_INDEX",
    "RAW_SAMPLE_SETS",
    "InputRole",
    "InputSet",
    "InputSpec",
    "InputSynthesis",
    "ModelFacts",
    "analyze",
    "cache_pairs",
    "generate_input_sets",
    "graph_inputs",
    "index_ranges",
    "load_raw_samples",
    "load_samples",
    "make_input_sets",
    "serving_input_set",
]
