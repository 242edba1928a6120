"""Held-out probe (issue 17): classic machine-learning models converted by skl2onnx and onnxmltools.

Platform teams serve more than networks: a fraud or churn model is a scikit-learn pipeline, a LightGBM or
XGBoost ensemble. Their graphs use the ``ai.onnx.ml`` domain (TreeEnsemble*, LinearClassifier, SVM*, Scaler,
Normalizer, ZipMap, ...), carry a label output beside the probabilities, and by default a ``ZipMap`` that turns
the probabilities into a sequence of maps (a non-tensor output). Two steps, two Pythons (the converters and
the boosting libraries are no dependency of this project):

    python3 -m venv /tmp/skenv && /tmp/skenv/bin/pip install skl2onnx onnxmltools lightgbm xgboost onnx
    /tmp/skenv/bin/python bench/heldout_classic_ml.py build         # writes bench/out/heldout/classic/*.onnx
    .venv/bin/python -m bench.heldout_classic_ml run                 # a fast job on each (bench.coverage.run_job)

Models (fitted on 400 rows of a synthetic 12-feature task, float inputs with a dynamic batch, the converters'
default options unless the name says otherwise): logistic regression (with its ZipMap, and ``zipmap=False``), a
random forest, gradient boosting regression, a scaler + PCA + RBF-SVC pipeline, an MLP, k-means, a
column-transformer pipeline with one-hot categories (string input), a TF-IDF text classifier (string input,
tokenized in the graph), LightGBM and XGBoost classifiers, and ``*_default``: a forest with string class labels,
the MLP and LightGBM with the converters' default ZipMap output.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "bench" / "out" / "heldout" / "classic"


def build() -> None:
    import numpy as np
    import onnx
    import onnxruntime as ort
    from lightgbm import LGBMClassifier
    from onnxmltools import convert_lightgbm, convert_xgboost
    from onnxmltools.convert.common.data_types import FloatTensorType as MlFloat
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType, StringTensorType
    from sklearn.cluster import KMeans
    from sklearn.compose import ColumnTransformer
    from sklearn.datasets import make_classification
    from sklearn.decomposition import PCA
    from sklearn.ensemble import GradientBoostingRegressor, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler
    from sklearn.svm import SVC
    from xgboost import XGBClassifier

    OUT.mkdir(parents=True, exist_ok=True)
    x, y = make_classification(n_samples=400, n_features=12, n_informative=6, n_classes=3, random_state=0)
    x = x.astype(np.float32)
    floats = [("features", FloatTensorType([None, 12]))]

    def save(proto: onnx.ModelProto, name: str, feed: dict) -> None:
        onnx.checker.check_model(proto, full_check=True)
        onnx.save(proto, str(OUT / f"{name}.onnx"))
        outs = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)
        print(name, len(proto.graph.node), "nodes", [type(o).__name__ for o in outs])

    feed = {"features": x[:5]}
    save(to_onnx(LogisticRegression(max_iter=500).fit(x, y), initial_types=floats), "sk_logreg_zipmap", feed)
    save(
        to_onnx(LogisticRegression(max_iter=500).fit(x, y), initial_types=floats, options={"zipmap": False}),
        "sk_logreg",
        feed,
    )
    forest = RandomForestClassifier(n_estimators=20, max_depth=6, random_state=0).fit(x, y)
    save(to_onnx(forest, initial_types=floats, options={"zipmap": False}), "sk_forest", feed)
    gbr = GradientBoostingRegressor(n_estimators=30, random_state=0).fit(x, y.astype(np.float32))
    save(to_onnx(gbr, initial_types=floats), "sk_gbr", feed)
    svc = make_pipeline(StandardScaler(), PCA(6), SVC(probability=True, random_state=0)).fit(x, y)
    save(to_onnx(svc, initial_types=floats, options={SVC: {"zipmap": False}}), "sk_pca_svc", feed)
    mlp = MLPClassifier((32, 16), max_iter=300, random_state=0).fit(x, y)
    save(to_onnx(mlp, initial_types=floats, options={"zipmap": False}), "sk_mlp", feed)
    save(to_onnx(KMeans(4, n_init=3, random_state=0).fit(x), initial_types=floats), "sk_kmeans", feed)

    colours = np.array(["red", "green", "blue"])[y % 3].reshape(-1, 1)
    mixed = ColumnTransformer([("num", StandardScaler(), [0, 1, 2]), ("cat", OneHotEncoder(), [3])])
    import pandas as pd

    frame = pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "colour": colours[:, 0]})
    mixed = ColumnTransformer([("num", StandardScaler(), ["a", "b", "c"]), ("cat", OneHotEncoder(), ["colour"])])
    pipe = make_pipeline(mixed, LogisticRegression(max_iter=500)).fit(frame, y)
    types = [(c, FloatTensorType([None, 1])) for c in "abc"] + [("colour", StringTensorType([None, 1]))]
    save(
        to_onnx(pipe, initial_types=types, options={LogisticRegression: {"zipmap": False}}),
        "sk_columns",
        {**{c: x[:5, i : i + 1] for i, c in enumerate("abc")}, "colour": colours[:5]},
    )

    # the converters' defaults, as a user sends them: ZipMap'ed probabilities, string class labels
    named = np.array(["low", "mid", "high"])[y]
    forest_named = RandomForestClassifier(n_estimators=10, max_depth=5, random_state=0).fit(x, named)
    save(to_onnx(forest_named, initial_types=floats), "sk_forest_default", feed)
    save(to_onnx(mlp, initial_types=floats), "sk_mlp_default", feed)
    lgbm_default = LGBMClassifier(n_estimators=10, num_leaves=7, verbose=-1).fit(x, y)
    save(convert_lightgbm(lgbm_default, initial_types=[("features", MlFloat([None, 12]))]), "lgbm_default", feed)
    from sklearn.feature_extraction.text import TfidfVectorizer

    docs = np.array([f"word{i % 7} token{i % 5} item{i % 3}" for i in range(400)])
    text = make_pipeline(TfidfVectorizer(), LogisticRegression(max_iter=300)).fit(docs, y)
    text_proto = to_onnx(
        text,
        initial_types=[("text", StringTensorType([None, 1]))],
        options={id(text[-1]): {"zipmap": False}, TfidfVectorizer: {"locale": "C"}},
    )
    save(text_proto, "sk_tfidf_text", {"text": docs[:5].reshape(-1, 1)})

    lgbm = LGBMClassifier(n_estimators=20, num_leaves=15, verbose=-1).fit(x, y)
    save(convert_lightgbm(lgbm, initial_types=[("features", MlFloat([None, 12]))], zipmap=False), "lgbm", feed)
    xgb = XGBClassifier(n_estimators=20, max_depth=4).fit(x, y)
    save(convert_xgboost(xgb, initial_types=[("features", MlFloat([None, 12]))]), "xgb", feed)


def run() -> None:
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from bench import _heldout

    _heldout.run_exports(sorted(OUT.glob("*.onnx")), ("ml ops", _ml_ops))


def _ml_ops(counts: dict) -> str:
    return str(counts.get("ml_ops", ""))


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1] if len(sys.argv) > 1 else "run"]()
