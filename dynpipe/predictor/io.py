"""A trained predictor as one JSON file: estimator, feature schema and provenance.

``save_predictor`` writes one JSON document (gzip-compressed when the name ends in
``.json.gz``): the fitted estimator as plain numbers (an xgboost model in xgboost's own JSON
model format; forests and ridge models as their arrays, see ``codec``), the feature schema,
the library versions it was trained with, a fingerprint of its training data (SHA-256 of the
dataset content) and, when evaluated, its accuracy summary.

Reading JSON can only make numbers and strings, so a predictor file from anywhere is safe
to load. Predictors saved by older versions as joblib pickles (``.joblib``) run code when
unpickled: ``load_predictor`` refuses them unless ``allow_pickle=True`` is passed, which
``dynpipe predictor convert OLD.joblib -o NEW.json --allow-pickle`` does once, for a file you
trust.
"""

from __future__ import annotations

import datetime as _dt
import gzip
import hashlib
import json
import platform
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from dynpipe.errors import UserError
from dynpipe.predictor.features import FeatureSchema, extract_features

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SUFFIXES",
    "Predictor",
    "dataset_fingerprint",
    "library_versions",
    "load_predictor",
    "save_predictor",
]

FORMAT = "dynpipe-predictor"
FORMAT_VERSION = 2
SUFFIXES = (".json", ".json.gz")
# Rows are sorted by these (where present) before hashing, so the fingerprint does not depend
# on row order or on the order the files were given.
_ID_COLUMNS = (
    "device_name",
    "model",
    "batch_size",
    "dtype",
    "condition",
    "layer_index",
    "phase",
)


@dataclass
class Predictor:
    """A fitted slowdown estimator with the schema of its input and where it came from."""

    estimator: object
    schema: FeatureSchema
    estimator_name: str
    data_fingerprint: str
    versions: dict[str, str]
    training: dict = field(default_factory=dict)
    report: dict | None = None
    created: str = ""

    def __post_init__(self) -> None:
        names = getattr(self.estimator, "feature_names_in_", None)
        if names is not None and list(names) != self.schema.names:
            raise UserError(
                f"predictor's estimator was fitted on {len(names)} features that differ from its "
                f"schema ({len(self.schema.names)}); the file is inconsistent, refit it with "
                "`dynpipe predictor fit`"
            )

    def features(self, df: pd.DataFrame) -> pd.DataFrame:
        """Feature matrix for profile-like rows under this predictor's schema."""
        return extract_features(df, schema=self.schema)[0]

    def predict_slowdown(self, df: pd.DataFrame) -> np.ndarray:
        """Predicted slowdown of each profile-like row (static columns + ``tel_*``)."""
        return self.estimator.predict(self.features(df))

    def predict_time_ms(self, df: pd.DataFrame) -> np.ndarray:
        """Predicted time of each row: ``time_alone_ms`` x predicted slowdown."""
        return df["time_alone_ms"].to_numpy(dtype=np.float64) * self.predict_slowdown(df)

    def __repr__(self) -> str:
        return (
            f"Predictor({self.estimator_name}, {len(self.schema.names)} features, "
            f"data {self.data_fingerprint[:12]}, trained {self.created or '?'})"
        )


def dataset_fingerprint(df: pd.DataFrame) -> str:
    """SHA-256 of a dataset's content: columns and values, independent of row order."""
    keys = [c for c in _ID_COLUMNS if c in df.columns]
    cols = sorted(map(str, df.columns))
    canon = df[cols].sort_values(keys, kind="stable").reset_index(drop=True) if keys else df[cols]
    # Array-valued cells (e.g. the raw timing samples) hash by their bytes.
    arrays = [
        c
        for c in cols
        if canon[c].dtype == object
        and len(canon)
        and isinstance(canon[c].iloc[0], (np.ndarray, list))
    ]
    if arrays:
        canon = canon.assign(**{c: canon[c].map(lambda v: np.asarray(v).tobytes()) for c in arrays})
    h = hashlib.sha256()
    h.update("\0".join(cols).encode())
    h.update(pd.util.hash_pandas_object(canon, index=False).to_numpy().tobytes())
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    import joblib
    import sklearn

    import dynpipe

    out = {
        "python": platform.python_version(),
        "dynpipe": dynpipe.__version__,
        "numpy": np.__version__,
        "pandas": pd.__version__,
        "scikit-learn": sklearn.__version__,
        "joblib": joblib.__version__,
    }
    try:
        import xgboost

        out["xgboost"] = xgboost.__version__
    except ImportError:  # the baselines do not need it
        pass
    return out


def save_predictor(predictor: Predictor, path: str | Path) -> Path:
    """Write ``predictor`` to ``path`` (``.json``, or ``.json.gz`` compressed); returns it."""
    from dynpipe.predictor.codec import encode_estimator

    path = Path(path)
    if not path.name.endswith(SUFFIXES):
        raise UserError(
            f"predictor files are JSON: name it {path.with_suffix('.json').name} or "
            f"{path.with_suffix('.json.gz').name}, not {path.name}"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "estimator_name": predictor.estimator_name,
        "schema": predictor.schema.to_dict(),
        "data_fingerprint": predictor.data_fingerprint,
        "versions": predictor.versions,
        "training": predictor.training,
        "report": predictor.report,
        "created": predictor.created
        or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        # Last, so the metadata above reads first in the file.
        "estimator": encode_estimator(predictor.estimator),
    }
    text = json.dumps(doc, default=_jsonable).encode()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(gzip.compress(text, mtime=0) if path.name.endswith(".gz") else text)
    tmp.replace(path)
    return path


def _jsonable(obj: object) -> object:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON data")


def _minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _read_document(path: Path, *, allow_pickle: bool) -> dict:
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as exc:
            raise UserError(
                f"predictor {path} is a damaged gzip file ({exc}); refit it with "
                "`dynpipe predictor fit`"
            ) from None
    if raw.lstrip()[:1] == b"{":
        try:
            return json.loads(raw.decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise UserError(
                f"predictor {path} is not valid JSON ({str(exc)[:80]}); refit it with "
                "`dynpipe predictor fit`"
            ) from None
    pickled = raw[:1] in (b"\x80", b"x") or path.suffix in (".joblib", ".pkl", ".pickle")
    if not pickled:
        raise UserError(
            f"{path} is not a dynpipe predictor (a JSON file from `dynpipe predictor fit`); "
            "train one with `dynpipe predictor fit`"
        )
    if not allow_pickle:
        raise UserError(
            f"{path} is a pickle (joblib) predictor from an older dynpipe: loading it runs any "
            "code it holds; if you trust it, convert it once with `dynpipe predictor convert "
            f"{path} -o {path.with_suffix('.json.gz')} --allow-pickle`, else refit"
        )
    import joblib

    try:
        artifact = joblib.load(path)
    except Exception as exc:  # any unpickling failure means "not a predictor we can read"
        raise UserError(
            f"cannot read predictor {path}: {type(exc).__name__}: {exc}; refit it with "
            "`dynpipe predictor fit`"
        ) from None
    if not isinstance(artifact, dict) or artifact.get("format") != FORMAT:
        raise UserError(
            f"{path} is not a dynpipe predictor file; train one with `dynpipe predictor fit`"
        )
    # Format 1: the same fields, with the fitted estimator object itself.
    return {**artifact, "format_version": FORMAT_VERSION, "estimator": artifact["estimator"]}


def load_predictor(
    path: str | Path,
    *,
    expect_features: Iterable[str] | None = None,
    allow_pickle: bool = False,
) -> Predictor:
    """Read a predictor saved by ``save_predictor``.

    ``expect_features``: the feature columns the caller will provide; a mismatch with the
    predictor's schema is refused with the missing and extra names. ``allow_pickle``: also
    read an older joblib predictor, which runs any code the file holds (trusted files only).
    """
    from dynpipe.predictor.codec import decode_estimator

    path = Path(path)
    if not path.is_file():
        raise UserError(
            f"predictor file {path} does not exist; train one with `dynpipe predictor fit`"
        )
    artifact = _read_document(path, allow_pickle=allow_pickle)
    if not isinstance(artifact, dict) or artifact.get("format") != FORMAT:
        raise UserError(
            f"{path} is not a dynpipe predictor file; train one with `dynpipe predictor fit`"
        )
    version = artifact.get("format_version", 0)
    if version != FORMAT_VERSION:
        raise UserError(
            f"{path} has predictor format {version!r} but this dynpipe reads format "
            f"{FORMAT_VERSION}; refit it with `dynpipe predictor fit`"
        )
    try:
        estimator = artifact["estimator"]
        if isinstance(estimator, dict):
            estimator = decode_estimator(estimator)
        schema = FeatureSchema.from_dict(artifact["schema"])
        saved = dict(artifact.get("versions") or {})
        fields = {
            "estimator_name": str(artifact["estimator_name"]),
            "data_fingerprint": str(artifact["data_fingerprint"]),
            "training": dict(artifact.get("training") or {}),
            "report": artifact.get("report"),
            "created": str(artifact.get("created", "")),
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise UserError(
            f"predictor {path} lacks or garbles {exc}; refit it with `dynpipe predictor fit`"
        ) from None
    now = library_versions()
    drift = [
        f"{lib} {saved[lib]} -> {now[lib]}"
        for lib in ("xgboost", "scikit-learn")
        if lib in saved and lib in now and _minor(saved[lib]) != _minor(now[lib])
    ]
    if drift:
        warnings.warn(
            f"predictor {path} was trained with other library versions ({'; '.join(drift)}); "
            "predictions may differ slightly, refit to be sure",
            stacklevel=2,
        )
    predictor = Predictor(estimator=estimator, schema=schema, versions=saved, **fields)
    if expect_features is not None:
        predictor.schema.check_names(expect_features, what=f"features for predictor {path.name}")
    return predictor
