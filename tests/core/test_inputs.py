"""core/inputs: inputs understood by role from the graph alone (issue 17 item 1), on real exports.

The three ``roles_*`` exports below failed before any pass ran, with "give shapes in the config or upload
samples.npz": a GPT-2 cache fed a mask that did not span past + new tokens, wav2vec2 fed 8 audio samples,
BART's classifier fed ids without its ``</s>``. They are committed (``tests/models/build_roles.py``), so
these tests need no torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from core.config import Tolerance
from core.errors import InvalidInputError
from core.inputs import GUESSES, InputSynthesis, analyze, generate_input_sets
from workers.verify import Verifier

MODELS = Path(__file__).resolve().parent.parent / "models"


def verified_sets(path: Path, count: int = 3):
    """The generated sets after the original model ran on each (and the Verifier adopted any retry)."""
    sets = generate_input_sets(onnx.load(str(path)), count)
    verifier = Verifier(path, sets, Tolerance())
    assert verifier.check(path).ok  # the original against itself: every set runs and compares exactly
    return sets


def test_generated_sets_run_a_gpt2_cache_when_the_mask_spans_past_and_new_tokens() -> None:
    sets = verified_sets(MODELS / "roles_gpt2_past.onnx")
    pasts = []
    for input_set in sets:
        ids, mask = input_set.feeds["input_ids"], input_set.feeds["attention_mask"]
        past = input_set.feeds["past_key_values.0.key"]
        assert past.shape[1] == 2 and past.shape[3] == 8  # heads and head size as the graph declares
        assert mask.shape == (ids.shape[0], past.shape[2] + ids.shape[1])
        assert mask[:, : past.shape[2]].all()  # the past is valid; padding falls in the new tokens
        assert ids.max() < 96  # the embedding table's rows
        assert input_set.provenance["inputs"]["past_key_values.0.key"]["role"] == "past_key_values"
        pasts.append(past.shape[2])
    assert 0 in pasts and max(pasts) > 0  # the first call (no past) and a later one


def test_generated_sets_run_wav2vec2_when_the_audio_is_long_enough_for_its_conv_stack() -> None:
    role = analyze(onnx.load(str(MODELS / "roles_wav2vec2.onnx"))).roles["input_values"]
    assert role.role == "audio" and role.min_length() == 400  # kernels 10,3,3,3,3,2,2 / strides 5,2,...
    sets = verified_sets(MODELS / "roles_wav2vec2.onnx")
    assert all(s.feeds["input_values"].shape[1] >= 400 for s in sets)
    assert "400 samples" in sets[0].provenance["inputs"]["input_values"]["why"]


def test_generated_sets_run_bart_classification_when_each_row_holds_one_eos_at_its_end() -> None:
    role = analyze(onnx.load(str(MODELS / "roles_bart_cls.onnx"))).roles["input_ids"]
    assert role.role == "token_ids" and role.markers == (2,) and role.high == 96
    for input_set in verified_sets(MODELS / "roles_bart_cls.onnx"):
        ids, mask = input_set.feeds["input_ids"], input_set.feeds["attention_mask"]
        assert ((ids == 2).sum(axis=1) == 1).all()
        last = mask.sum(axis=1) - 1
        assert (ids[np.arange(len(ids)), last] == 2).all()
        assert input_set.provenance["guess"] == "role-based" and not input_set.provenance["attempts"]


def _needs_twenty_positions() -> onnx.ModelProto:
    """y = x[:, 20]: runs only on sequences longer than 20, which the first guess (8) is not."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["y"], axis=1)],
        "needs_twenty",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])],
        [numpy_helper.from_array(np.array(20, np.int64), "i")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_verifier_tries_longer_sequences_and_records_why_when_the_first_guess_fails(tmp_path: Path) -> None:
    path = tmp_path / "needs_twenty.onnx"
    onnx.save(_needs_twenty_positions(), str(path))
    sets = generate_input_sets(onnx.load(str(path)), 2)
    assert sets[0].feeds["x"].shape == (1, 8)
    Verifier(path, sets, Tolerance())
    assert sets[0].feeds["x"].shape[1] > 20
    assert sets[0].provenance["guess"] == "longer sequences"
    attempts = sets[0].provenance["attempts"]
    assert [a["guess"] for a in attempts] == ["role-based"] and "Gather" in attempts[0]["error"]


def test_verifier_asks_for_shapes_after_every_guess_when_none_runs(tmp_path: Path) -> None:
    model = _needs_twenty_positions()
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array(5000, np.int64), "i"))
    path = tmp_path / "needs_5000.onnx"
    onnx.save(model, str(path))
    with pytest.raises(InvalidInputError, match=r"also tried: longer sequences.*give shapes in the config") as info:
        Verifier(path, generate_input_sets(model, 1), Tolerance())
    assert info.value.code == "MODEL_RUN_FAILED"


def _batch_one_only() -> onnx.ModelProto:
    """y = reshape(x, [1, -1]) + x: runs only on one row (torch's opset-23 Llama export is so: its rotary caches
    keep the example's batch of 1, and ONNX's RotaryEmbedding refuses any other batch)."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "flat"], ["row"]), helper.make_node("Add", ["row", "x"], ["y"])],
        "batch_one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "sequence"])],
        [numpy_helper.from_array(np.array([1, -1], np.int64), "flat")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_verifier_falls_back_to_one_row_when_the_model_refuses_every_batch_above_one(tmp_path: Path) -> None:
    path = tmp_path / "batch_one.onnx"
    onnx.save(_batch_one_only(), str(path))
    sets = generate_input_sets(onnx.load(str(path)), 3)
    assert [s.feeds["x"].shape[0] for s in sets] == [1, 2, 4]
    Verifier(path, sets, Tolerance())
    assert [s.feeds["x"].shape[0] for s in sets] == [1, 1, 1]
    lengths = [s.feeds["x"].shape[1] for s in sets]
    assert len(set(lengths)) == 3  # still three shapes: the sets differ in length
    assert sets[0].provenance["guess"] == "role-based"  # one row ran at once
    assert sets[1].provenance["guess"] == "one row (the model refused every batch above 1)"
    assert sets[1].provenance["attempts"][0]["guess"] == "role-based"


def _folded_rows(form: str) -> onnx.ModelProto:
    """``x [frames, 4]`` folded into clips of 2 frames and summed over each clip: X-CLIP's video tower takes a
    clip's frames flattened into the batch and folds them back. ``form``: TorchScript's (the clip count as
    ``Div(Gather(Shape(x), 0), 2)``) or dynamo's (``Reshape(x, [-1, 2, 4])``)."""
    inits = [numpy_helper.from_array(np.array([2, 4], np.int64), "clip"), numpy_helper.from_array(np.array([1]), "one")]
    if form == "ts":
        inits += [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(2), "two")]
        nodes = [
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Gather", ["shape", "zero"], ["frames"], axis=0),
            helper.make_node("Div", ["frames", "two"], ["clips"]),
            helper.make_node("Unsqueeze", ["clips", "zero_axis"], ["clips_1d"]),
            helper.make_node("Concat", ["clips_1d", "clip"], ["target"], axis=0),
        ]
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "zero_axis"))
    else:
        inits.append(numpy_helper.from_array(np.array([-1, 2, 4], np.int64), "target"))
        nodes = []
    nodes += [
        helper.make_node("Reshape", ["x", "target"], ["grouped"]),
        helper.make_node("ReduceSum", ["grouped", "one"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        f"folded_rows_{form}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["frames", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["clips", 1, 4])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("form", ["ts", "dynamo"])
def test_verifier_feeds_whole_row_groups_to_a_graph_that_folds_its_batch(tmp_path: Path, form: str) -> None:
    model = _folded_rows(form)
    assert analyze(model).row_group == 2
    path = tmp_path / f"folded_{form}.onnx"
    onnx.save(model, str(path))
    sets = generate_input_sets(onnx.load(str(path)), 3)
    Verifier(path, sets, Tolerance())  # one frame fails to fold; every set runs after the guess
    assert [s.feeds["x"].shape[0] for s in sets] == [2, 2, 4]  # sets 1 and 2 (batches 2 and 4) ran as made
    assert sets[0].provenance["guess"] == "batches in the graph's row groups (it folds its leading axis)"
    assert sets[0].provenance["attempts"][0]["guess"] == "role-based"
    assert [s.provenance["guess"] for s in sets[1:]] == ["role-based"] * 2


def test_a_graph_that_folds_nothing_skips_the_row_group_guess(tmp_path: Path) -> None:
    path = tmp_path / "batch_one.onnx"
    onnx.save(_batch_one_only(), str(path))
    sets = generate_input_sets(onnx.load(str(path)), 2)
    Verifier(path, sets, Tolerance())
    tried = [a["guess"] for a in sets[1].provenance["attempts"]]
    assert tried and not any("row groups" in g for g in tried)


def _pyramid_pooled(row: int) -> onnx.ModelProto:
    """A patch stem (16x16, stride 16) and the pooled map's row ``row`` read: runs only on images ``16 * (row +
    1)`` pixels high or more, as UperNet's pyramid pooling exported by dynamo needs 128."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["pixel_values", "w"], ["f"], kernel_shape=[16, 16], strides=[16, 16]),
            helper.make_node("Gather", ["f", "row"], ["y"], axis=2),
        ],
        "pyramid",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, "height", 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 4])],
        [
            numpy_helper.from_array(rng.standard_normal((8, 3, 16, 16)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array(row, np.int64), "row"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_verifier_tries_larger_images_when_the_model_needs_more_pixels(tmp_path: Path) -> None:
    synthesis = InputSynthesis(_pyramid_pooled(0))
    longer = next(g for g in GUESSES if g.seq_scale > 1)
    larger = next(g for g in GUESSES if g.image_scale > 1)
    first = synthesis.bind(0)["pixel_values"]
    assert synthesis.bind(0, larger)["pixel_values"] == (first[0], 3, first[2] * 4, 64)  # the free side only
    side = max(synthesis.bind(0, longer)["pixel_values"][2], first[2])
    assert side < first[2] * 4  # so that the model below needs the larger images
    path = tmp_path / "pyramid.onnx"
    onnx.save(_pyramid_pooled(first[2] * 4 // 16 - 1), str(path))
    sets = generate_input_sets(onnx.load(str(path)), 1)
    Verifier(path, sets, Tolerance())
    assert sets[0].feeds["pixel_values"].shape[2] == first[2] * 4
    assert sets[0].provenance["guess"] == larger.name


def _conv_features_model() -> onnx.ModelProto:
    """Whisper's encoder in small: [batch, 4 mels, frames] -> Conv(k3, p1) -> Conv(k3, s2, p1) -> Transpose ->
    + a 6-row position table: only 11 or 12 frames give the 6 positions the table needs."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 4, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((8, 8, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.standard_normal((6, 8)).astype(np.float32), "embed_positions"),
    ]
    nodes = [
        helper.make_node("Conv", ["features", "w1"], ["c1"], kernel_shape=[3], pads=[1, 1]),
        helper.make_node("Conv", ["c1", "w2"], ["c2"], kernel_shape=[3], pads=[1, 1], strides=[2]),
        helper.make_node("Transpose", ["c2"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Add", ["t", "embed_positions"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "features",
        [helper.make_tensor_value_info("features", TensorProto.FLOAT, ["batch", 4, "frames"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 6, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_generated_sets_fix_the_frames_when_a_position_table_follows_the_conv_stack(tmp_path: Path) -> None:
    model = _conv_features_model()
    role = analyze(model).roles["features"]
    assert role.role == "features" and role.exact_out == 6 and role.channels == 4
    path = tmp_path / "features.onnx"
    onnx.save(model, str(path))
    sets = generate_input_sets(model, 3)
    assert {s.feeds["features"].shape[1:] for s in sets} == {(4, 11)}
    Verifier(path, sets, Tolerance())
    assert all(s.provenance["guess"] == "role-based" for s in sets)


def _vit_free_size_model(gathered: bool) -> onnx.ModelProto:
    """ViT's embeddings as Optimum exports them (``bench/heldout_optimum.py``: height and width declared dynamic,
    the position table fixed): [batch, 3, H, W] -> Conv(8x8 patches, stride 8) -> flatten -> Transpose -> Concat
    after the class token -> + a 17-row table, a parameter (ViT's) or, ``gathered``, an embedding table's rows
    0..16 (CLIP's vision tower: ``position_embedding(position_ids)``). Only 32 x 32 pixels give the 16 patches
    (+ [CLS]) it needs."""
    rng = np.random.default_rng(0)
    table = rng.standard_normal((17, 8) if gathered else (1, 17, 8)).astype(np.float32)
    inits = [
        numpy_helper.from_array(rng.standard_normal((8, 3, 8, 8)).astype(np.float32), "patch"),
        numpy_helper.from_array(rng.standard_normal((1, 1, 8)).astype(np.float32), "cls_token"),
        numpy_helper.from_array(table, "position_embeddings"),
        numpy_helper.from_array(np.arange(17, dtype=np.int64)[None], "position_ids"),
        numpy_helper.from_array(np.array([0, 8, -1], dtype=np.int64), "flat"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "one"),
        numpy_helper.from_array(np.array([0], dtype=np.int64), "zero"),
    ]
    nodes = [
        helper.make_node("Conv", ["pixel_values", "patch"], ["c"], kernel_shape=[8, 8], strides=[8, 8]),
        helper.make_node("Reshape", ["c", "flat"], ["f"]),
        helper.make_node("Transpose", ["f"], ["t"], perm=[0, 2, 1]),
        helper.make_node("Shape", ["pixel_values"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
        helper.make_node("Concat", ["batch", "one", "one"], ["cls_shape"], axis=0),
        helper.make_node("Expand", ["cls_token", "cls_shape"], ["cls"]),
        helper.make_node("Concat", ["cls", "t"], ["tokens"], axis=1),
        helper.make_node("Add", ["tokens", "positions" if gathered else "position_embeddings"], ["y"]),
    ]
    if gathered:
        nodes.insert(-1, helper.make_node("Gather", ["position_embeddings", "position_ids"], ["positions"]))
    graph = helper.make_graph(
        nodes,
        "vit",
        [helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT, ["batch", 3, "height", "width"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 17, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("gathered", [False, True], ids=["table", "gathered_rows"])
def test_generated_sets_fix_the_image_size_when_a_class_token_is_concatenated_before_the_table(
    tmp_path: Path, gathered: bool
) -> None:
    model = _vit_free_size_model(gathered)
    role = analyze(model).roles["pixel_values"]
    assert role.role == "pixel_values" and role.exact_out == 4
    path = tmp_path / "vit.onnx"
    onnx.save(model, str(path))
    sets = generate_input_sets(model, 3)
    assert {s.feeds["pixel_values"].shape[1:] for s in sets} == {(3, 32, 32)}
    Verifier(path, sets, Tolerance())  # the model runs on every set
    assert InputSynthesis(model).serving_image_set(224) is None  # the table fixes the size: no second look


def test_feeds_at_keeps_previous_roles_when_the_model_is_a_plain_encoder() -> None:
    model = onnx.load(str(MODELS / "hf_bert_encoder.onnx"))
    feeds = InputSynthesis(model).feeds_at(3, 16, np.random.default_rng(0))
    assert {k: v.shape for k, v in feeds.items()} == dict.fromkeys(
        ("input_ids", "attention_mask", "token_type_ids"), (3, 16)
    )
    assert feeds["input_ids"].max() < 256 and set(np.unique(feeds["token_type_ids"])) <= {0, 1}
    assert feeds["attention_mask"][0].all()


@pytest.mark.parametrize("name", ["decoders/llama_past_ts.onnx", "decoders/llama_past_dynamo.onnx"])
def test_feeds_at_decodes_one_token_per_row_when_a_cached_lm_gets_several_rows(name: str) -> None:
    """A pass's own inputs (no samples) on a cached decoder-only LM: several rows after a past decode one new token
    each, as generation calls it (GroupQueryAttention refuses several rows of several new tokens on a past)."""
    synthesis = InputSynthesis(onnx.load(str(MODELS / name), load_external_data=False))
    rng = np.random.default_rng(0)
    one, several = synthesis.feeds_at(1, 7, rng), synthesis.feeds_at(3, 16, rng)
    assert one["input_ids"].shape == (1, 7)
    assert several["input_ids"].shape == (3, 1)
    past = next(v for k, v in several.items() if k.startswith("past_key_values"))
    assert past.shape[0] == 3 and past.shape[2] == 16
    assert several["attention_mask"].shape == (3, 17)


@pytest.mark.parametrize(
    "name", ["decoders/llama_past_ts.onnx", "decoders/llama_past_dynamo.onnx", "roles_gpt2_past.onnx"]
)
def test_feeds_for_sizes_spans_the_mask_over_past_and_the_bound_new_tokens(name: str) -> None:
    """A mask with a dim name of its own follows the sequence the caller binds, not the first guess's."""
    synthesis = InputSynthesis(onnx.load(str(MODELS / name), load_external_data=False))
    sizes = {dim: {"batch": 2, "sequence": 37, "past": 5}[plan["role"]] for dim, plan in synthesis.free_dims().items()}
    feeds = synthesis.feeds_for_sizes(sizes, np.random.default_rng(0))
    assert feeds["input_ids"].shape == (2, 37)
    assert feeds["attention_mask"].shape == (2, 5 + 37)


@pytest.mark.parametrize(
    ("name", "causal_lm"),
    [
        ("decoders/llama_past_ts.onnx", True),
        ("decoders/qwen2_past_dynamo.onnx", True),
        ("decoders/phi3_nopast_ts.onnx", True),  # no cache: the causal mask computed in the graph decides
        ("decoders/gpt2_nopast_dynamo.onnx", True),
        ("roles_gpt2_past.onnx", True),
        ("hf_bert_encoder.onnx", False),  # token types, no causal mask
        ("hf_xlnet.onnx", False),
        ("corpus/clip_text_dynamo.onnx", False),  # a causal mask, but a text embedding out, not logits
        ("roles_bart_cls.onnx", False),  # selects positions by </s>: a classifier
        ("corpus/bart_dynamo.onnx", False),  # encoder and decoder ids: a seq2seq model
    ],
)
def test_analyze_tells_a_decoder_only_language_model_from_encoders_when_reading_the_graph(name, causal_lm) -> None:
    facts = analyze(onnx.load(str(MODELS / name), load_external_data=False))
    assert facts.causal_lm is causal_lm


@pytest.mark.parametrize("name", ["decoders/llama_past_ts.onnx", "decoders/mistral_past_dynamo.onnx"])
def test_generated_sets_are_unpadded_generation_calls_when_decoder_with_a_cache(name: str) -> None:
    """Sets GroupQueryAttention can be verified on: a batch-1 prompt after a past, a batch-2 prefill on an
    empty past, batch 4 decoding one token on a past; masks all ones, positions counting on from the past."""
    sets = verified_sets(MODELS / name)
    calls = []
    for input_set in sets:
        feeds = input_set.feeds
        batch, seq = feeds["input_ids"].shape
        past = feeds["past_key_values.0.key"].shape[2]
        assert feeds["attention_mask"].shape == (batch, past + seq) and feeds["attention_mask"].all()
        np.testing.assert_array_equal(feeds["position_ids"], np.broadcast_to(np.arange(past, past + seq), (batch, seq)))
        assert "decoder-only language model" in input_set.provenance["why"]
        calls.append((batch, seq, past))
    assert calls == [(1, 8, 8), (2, 16, 0), (4, 1, 32)]
    assert "decode: 4 row(s) of 1 new token on a past of 32" in sets[2].provenance["why"]


def test_generated_sets_keep_padded_masks_when_encoder_or_causal_text_tower() -> None:
    for name in ("hf_bert_encoder.onnx", "corpus/clip_text_dynamo.onnx"):
        sets = generate_input_sets(onnx.load(str(MODELS / name)), 3)
        assert any((s.feeds["attention_mask"] == 0).any() for s in sets), name
        assert all("why" not in s.provenance for s in sets)
    nopast = generate_input_sets(onnx.load(str(MODELS / "decoders/llama_nopast_ts.onnx")), 3)
    assert [s.feeds["input_ids"].shape for s in nopast] == [(1, 8), (2, 16), (4, 32)]
    assert all(s.feeds["attention_mask"].all() for s in nopast)


def test_analyze_reads_token_ids_through_an_int4_embedding_table_when_gatherblockquantized() -> None:
    """quantize_int4's GatherBlockQuantized table ([rows, packed columns], indexed on gather_axis) still makes
    its index input the token ids, bounded by the table's rows (an int4 artifact fed by role)."""
    rows, hidden = 40, 16
    table = numpy_helper.from_array(np.zeros((rows, hidden // 2), np.uint8), "table_q4")
    scales = numpy_helper.from_array(np.ones((rows, hidden // 16), np.float32), "table_scales")
    node = helper.make_node(
        "GatherBlockQuantized", ["table_q4", "input_ids", "table_scales"], ["emb"], domain="com.microsoft",
        gather_axis=0, quantize_axis=1, block_size=16, bits=4,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, None)],
        [table, scales],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )
    role = analyze(model).roles["input_ids"]
    assert role.role == "token_ids" and role.high == rows


def _categorical_model(zeros: int) -> onnx.ModelProto:
    """skl2onnx's layout of a ColumnTransformer's categorical column: a string input gathered to one column,
    one-hot encoded by the categories it was fitted on (``zeros=0``: an unseen category is an error)."""
    nodes = [
        helper.make_node("Gather", ["colour", "column"], ["picked"], axis=1),
        helper.make_node("OneHotEncoder", ["picked"], ["onehot"], domain="ai.onnx.ml",
                         cats_strings=["red", "green", "blue"], zeros=zeros),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "categorical",
        [helper.make_tensor_value_info("colour", TensorProto.STRING, [None, 1])],
        [helper.make_tensor_value_info("onehot", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array([0], np.int64), "column")],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_generated_strings_are_the_categories_of_the_encoder_that_reads_them(tmp_path: Path) -> None:
    # Before: "input 'colour' has dtype object, for which no inputs can be generated; upload samples.npz".
    model = _categorical_model(zeros=0)
    role = analyze(model).roles["colour"]
    assert role.role == "strings" and role.words == ("red", "green", "blue") and "OneHotEncoder" in role.why
    path = tmp_path / "categorical.onnx"
    onnx.save(model, str(path))
    sets = verified_sets(path)
    values = {str(v) for s in sets for v in s.feeds["colour"].ravel()}
    assert values <= {"red", "green", "blue"} and len(values) > 1
    assert {s.feeds["colour"].dtype for s in sets} == {np.dtype(object)}


def test_generated_strings_are_plain_words_when_no_category_table_reads_them() -> None:
    graph = helper.make_graph(
        [helper.make_node("StringNormalizer", ["text"], ["lower"], case_change_action="LOWER")],
        "normalize",
        [helper.make_tensor_value_info("text", TensorProto.STRING, [None])],
        [helper.make_tensor_value_info("lower", TensorProto.STRING, None)],
    )
    role = analyze(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).roles["text"]
    assert role.role == "strings" and role.words and "no category table" in role.why


def test_generated_bag_offsets_ascend_from_zero_within_the_indices() -> None:
    # torch's EmbeddingBag(indices, offsets) exports a Loop over the bags, each reading indices[offsets[i]:
    # offsets[i + 1]]: random offsets (they were "integer input not read as an index") made bags run backwards.
    table = numpy_helper.from_array(np.arange(400, dtype=np.float32).reshape(100, 4), "table")
    nodes = [
        helper.make_node("Gather", ["table", "indices"], ["rows"]),
        helper.make_node("Shape", ["offsets"], ["bags"]),
    ]
    value = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes,
        "bag",
        [value("indices", TensorProto.INT64, ["n"]), value("offsets", TensorProto.INT64, ["b"])],
        [value("rows", TensorProto.FLOAT, None), value("bags", TensorProto.INT64, None)],
        [table],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert analyze(model).roles["offsets"].role == "offsets"
    for s in generate_input_sets(model, 4):
        offsets, length = s.feeds["offsets"], s.feeds["indices"].shape[0]
        assert offsets[0] == 0 and np.all(np.diff(offsets) >= 0) and offsets.max() <= length, (offsets, length)


def _graph_network() -> onnx.ModelProto:
    """A graph convolution as torch exports ``index_add_`` message passing: node features gathered at each
    edge's source and scattered (summed) onto its destination; ``edge_index`` must hold node numbers."""
    value = helper.make_tensor_value_info
    consts = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([-1, 1], np.int64), "column"),
        numpy_helper.from_array(np.array([1, 8], np.int64), "width"),
    ]
    nodes = [
        helper.make_node("Gather", ["edge_index", "zero"], ["src"], axis=0),
        helper.make_node("Gather", ["edge_index", "one"], ["dst"], axis=0),
        helper.make_node("Gather", ["x", "src"], ["messages"], axis=0),
        helper.make_node("Reshape", ["dst", "column"], ["dst_column"]),
        helper.make_node("Shape", ["messages"], ["messages_shape"]),
        helper.make_node("Expand", ["dst_column", "messages_shape"], ["targets"]),
        helper.make_node("ScatterElements", ["x", "targets", "messages"], ["out"], axis=0, reduction="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "gcn",
        [value("x", TensorProto.FLOAT, ["num_nodes", 8]), value("edge_index", TensorProto.INT64, [2, "num_edges"])],
        [value("out", TensorProto.FLOAT, ["num_nodes", 8])],
        consts,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_generated_sets_run_a_graph_network_when_its_edges_index_its_nodes(tmp_path: Path) -> None:
    # Before: "the original model fails on input set 'x=1x8; edge_index=2x8': ScatterElements ... indices element
    # out of data bounds" after every guess: edge_index was drawn below 10 whatever the node count.
    path = tmp_path / "gcn.onnx"
    onnx.save(_graph_network(), str(path))
    sets = verified_sets(path)
    for s in sets:
        assert s.feeds["edge_index"].max() < s.feeds["x"].shape[0]
        assert s.provenance["guess"].startswith("integers below the float inputs' free sizes")
        assert "below the smallest free axis" in s.provenance["inputs"]["edge_index"]["why"]


def test_generated_lengths_are_within_the_time_axis_and_never_zero(tmp_path: Path) -> None:
    # An ASR encoder's (features, length) pair, as NeMo's and torchaudio's exports take it: the length masks the
    # frames and divides their sum. Drawn below 10 as a plain integer, a length of 0 made a row NaN.
    value = helper.make_tensor_value_info
    consts = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "step"),
        numpy_helper.from_array(np.array(2, np.int64), "time_axis"),
        numpy_helper.from_array(np.array([-1, 1], np.int64), "column"),
        numpy_helper.from_array(np.array([2], np.int64), "reduce_time"),
    ]
    nodes = [
        helper.make_node("Shape", ["features"], ["shape"]),
        helper.make_node("Gather", ["shape", "time_axis"], ["frames"]),
        helper.make_node("Range", ["zero", "frames", "step"], ["positions"]),
        helper.make_node("Reshape", ["length", "column"], ["length_column"]),
        helper.make_node("Less", ["positions", "length_column"], ["valid"]),
        helper.make_node("Cast", ["valid"], ["valid_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["valid_f", "step"], ["valid_3d"]),
        helper.make_node("Mul", ["features", "valid_3d"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "reduce_time"], ["total"], keepdims=0),
        helper.make_node("Cast", ["length_column"], ["count"], to=TensorProto.FLOAT),
        helper.make_node("Div", ["total", "count"], ["pooled"]),
    ]
    graph = helper.make_graph(
        nodes,
        "asr_pool",
        [value("features", TensorProto.FLOAT, ["batch", 16, "time"]), value("length", TensorProto.INT64, ["batch"])],
        [value("pooled", TensorProto.FLOAT, ["batch", 16])],
        consts,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert analyze(model).roles["length"].role == "lengths"
    path = tmp_path / "asr_pool.onnx"
    onnx.save(model, str(path))
    for s in verified_sets(path):
        length, frames = s.feeds["length"], s.feeds["features"].shape[2]
        assert length.min() >= 1 and length.max() == frames, (length, frames)


def _waveform_codec(tmp_path: Path) -> Path:
    """EnCodec's encoder as its TorchScript export writes it: a mono waveform ``[batch, 1, samples]``, each
    convolution behind a reflect Pad (which fails unless the signal is longer than the pad) and a Slice that
    crops it, an Elu between, strides 4 and 8. Sized as one frame of features (8 samples), it failed."""
    nodes, inits = [], []
    x = "input_values"
    for i, (kernel, stride, channels_in, channels_out) in enumerate([(7, 1, 1, 4), (8, 4, 4, 8), (16, 8, 8, 8)]):
        pad = kernel - stride
        inits += [
            numpy_helper.from_array(np.array([0, 0, pad, 0, 0, 0], np.int64), f"pads{i}"),
            numpy_helper.from_array(np.array([0], np.int64), f"start{i}"),
            numpy_helper.from_array(np.array([1 << 30], np.int64), f"end{i}"),
            numpy_helper.from_array(np.array([2], np.int64), f"axis{i}"),
            numpy_helper.from_array(
                np.random.default_rng(i).normal(size=(channels_out, channels_in, kernel)).astype(np.float32), f"w{i}"
            ),
        ]
        nodes += [
            helper.make_node("Pad", [x, f"pads{i}"], [f"padded{i}"], mode="reflect"),
            helper.make_node("Slice", [f"padded{i}", f"start{i}", f"end{i}", f"axis{i}"], [f"cropped{i}"]),
            helper.make_node("Conv", [f"cropped{i}", f"w{i}"], [f"conv{i}"], kernel_shape=[kernel], strides=[stride]),
            helper.make_node("Elu", [f"conv{i}"], [f"act{i}"]),
        ]
        x = f"act{i}"
    graph = helper.make_graph(
        nodes,
        "codec",
        [helper.make_tensor_value_info("input_values", TensorProto.FLOAT, ["batch", 1, "samples"])],
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, None)],
        inits,
    )
    path = tmp_path / "codec.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_a_mono_waveform_with_its_channel_axis_is_sized_for_its_strided_conv_stack(tmp_path: Path) -> None:
    path = _waveform_codec(tmp_path)
    role = analyze(onnx.load(str(path))).roles["input_values"]
    assert role.role == "audio" and role.channels == 1 and len(role.convs) == 3
    assert "[batch, 1, samples]" in role.why
    sets = verified_sets(path)
    for input_set in sets:
        _batch, channels, samples = input_set.feeds["input_values"].shape
        assert channels == 1 and samples >= role.min_length(8)  # at least 8 frames out of the stride-32 stack
    assert sets[0].provenance["guess"] == "role-based"
    free = InputSynthesis(onnx.load(str(path))).free_dims()
    assert free["samples"] == {"role": "sequence", "min": role.min_length(1)}


def _codebook_ids(target_from_input: bool) -> onnx.ModelProto:
    """MusicGen's decoder input: ``input_ids [batch * 2, S]`` viewed as ``[-1, 2, S]`` (S read off the input when
    ``target_from_input``, as both exporters write it; else a constant S of 8, a fixed length), each codebook's ids
    selected by ``Gather(axis=1)`` and looked up in its own table of 65 rows."""
    rng = np.random.default_rng(0)
    nodes = []
    if target_from_input:
        nodes += [
            helper.make_node("Shape", ["input_ids"], ["shape"]),
            helper.make_node("Gather", ["shape", "one"], ["length"], axis=0),
            helper.make_node("Unsqueeze", ["length", "zero_axis"], ["length_1d"]),
            helper.make_node("Concat", ["minus_one", "two", "length_1d"], ["target"], axis=0),
        ]
    nodes += [
        helper.make_node("Reshape", ["input_ids", "target"], ["codes"]),
        helper.make_node("Gather", ["codes", "zero"], ["ids_0"], axis=1),
        helper.make_node("Gather", ["codes", "one"], ["ids_1"], axis=1),
        helper.make_node("Gather", ["table_0", "ids_0"], ["e0"]),
        helper.make_node("Gather", ["table_1", "ids_1"], ["e1"]),
        helper.make_node("Add", ["e0", "e1"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(rng.standard_normal((65, 8)).astype(np.float32), "table_0"),
        numpy_helper.from_array(rng.standard_normal((65, 8)).astype(np.float32), "table_1"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "zero_axis"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
    ]
    length: str | int = "sequence"
    if not target_from_input:  # a constant view of a fixed length
        inits.append(numpy_helper.from_array(np.array([-1, 2, 8], np.int64), "target"))
        length = 8
    graph = helper.make_graph(
        nodes,
        "codebooks",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_codebooks", length])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target_from_input", [True, False])
def test_codebook_ids_get_whole_row_groups_and_each_tables_vocabulary(tmp_path: Path, target_from_input: bool) -> None:
    """MusicGen's jobs failed before any pass ran: the view's target, a Concat with the input's own length, hid
    the row group, and ids selected per codebook (a Gather on axis 1) were no ids of a table (values up to 100)."""
    model = _codebook_ids(target_from_input)
    facts = analyze(model)
    assert facts.row_group == 2
    assert facts.roles["input_ids"].high == 65
    path = tmp_path / "codebooks.onnx"
    onnx.save(model, str(path))
    sets = generate_input_sets(onnx.load(str(path)), 3)
    Verifier(path, sets, Tolerance())  # the first set's batch of 1 is refused, its row-group guess runs
    assert all(s.feeds["input_ids"].shape[0] % 2 == 0 for s in sets)
    assert all(s.feeds["input_ids"].max() < 65 for s in sets)
