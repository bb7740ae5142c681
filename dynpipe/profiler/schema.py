"""The profile-dataset schema shared by the profiler (writer) and the predictor (reader).

A dataset is a parquet file with one row per (layer, phase, condition) and the dataset's
provenance as JSON in the parquet key-value metadata under ``dynpipe``. The column lists
below are the contract; ``load_profiles`` refuses a file that breaks it with one line that
names the offending columns, so a renamed column never silently turns into a missing feature.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dynpipe.devices.columns import TELEMETRY_COLUMNS
from dynpipe.errors import UserError

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "COLUMNS",
    "CONDITION_COLUMNS",
    "EXTRA_COLUMNS",
    "IDENTITY_COLUMNS",
    "META_KEY",
    "SCHEMA_VERSION",
    "STATIC_COLUMNS",
    "TARGET_COLUMNS",
    "load_profiles",
    "read_metadata",
    "validate_frame",
    "write_profiles",
]

SCHEMA_VERSION = 1
META_KEY = "dynpipe"

# name -> "str" | "int" | "float": the dtype family each column must have.
IDENTITY_COLUMNS: dict[str, str] = {
    "model": "str",
    "layer": "str",
    "layer_index": "int",
    "kind": "str",
    "phase": "str",
    "batch_size": "int",
    "dtype": "str",
    "device_type": "str",
    "device_name": "str",
}
STATIC_COLUMNS: dict[str, str] = {
    "flops": "float",
    "param_bytes": "int",
    "in_bytes": "int",
    "out_bytes": "int",
    "arith_intensity": "float",
}
CONDITION_COLUMNS: dict[str, str] = {
    "condition": "str",
    "interferer": "str",
    "intensity": "float",
    "n_jobs": "int",
}
TARGET_COLUMNS: dict[str, str] = {
    "time_ms": "float",
    "time_p10_ms": "float",
    "time_p90_ms": "float",
    "repeats": "int",
    "time_alone_ms": "float",
    "slowdown": "float",
}
COLUMNS: dict[str, str] = {
    **IDENTITY_COLUMNS,
    **STATIC_COLUMNS,
    **CONDITION_COLUMNS,
    **TELEMETRY_COLUMNS,
    **TARGET_COLUMNS,
}
# Written by ``dynpipe profile`` beside the contract columns; readers may ignore them.
EXTRA_COLUMNS: dict[str, str] = {
    "param_count": "int",
    "iters_per_sample": "int",  # back-to-back iterations averaged into one timing sample
    "tel_samples": "int",  # telemetry ticks behind the tel_* means
    "samples_ms": "list",  # every timing sample behind time_ms (ms per iteration)
    # What the layer's operators do (dynpipe.profiler.work); older files get them from
    # dynpipe.profiler.work.add_work.
    "work_flops": "float",
    "work_bytes": "float",
    "work_launches": "float",
    "work_max_op_bytes": "float",
    **{
        f"work_bytes_{k}": "float"
        for k in ("matmul", "conv", "conv_grouped", "attention", "norm", "elementwise", "other")
    },
    **{f"work_flops_{k}": "float" for k in ("matmul", "conv", "conv_grouped", "attention")},
}

_PHASES = ("fwd", "bwd")
_REQUIRED_META = ("device_name", "device_type", "driver", "torch_version", "date", "command")


def validate_frame(df: pd.DataFrame, *, source: str = "dataset") -> None:
    """Raise one-line ``UserError`` unless ``df`` has every schema column with its dtype."""
    import pandas as pd

    missing = [c for c in COLUMNS if c not in df.columns]
    if missing:
        unknown = [c for c in df.columns if c not in COLUMNS and c not in EXTRA_COLUMNS]
        hint = f" and has unexpected {', '.join(map(str, unknown))} (renamed?)" if unknown else ""
        raise UserError(
            f"{source} lacks column(s) {', '.join(missing)}{hint}; it does not follow profile "
            f"schema v{SCHEMA_VERSION} — regenerate it with `dynpipe profile` or restore the "
            "column names listed in profiles/README.md"
        )
    bad = []
    for name, family in COLUMNS.items():
        col = df[name]
        if family == "str":
            ok = pd.api.types.is_object_dtype(col) or pd.api.types.is_string_dtype(col)
        elif family == "int":
            ok = pd.api.types.is_integer_dtype(col)
        else:
            ok = pd.api.types.is_numeric_dtype(col) and not pd.api.types.is_bool_dtype(col)
        if not ok:
            bad.append(f"{name} ({col.dtype}, want {family})")
    if bad:
        raise UserError(
            f"{source} has column(s) of the wrong type: {', '.join(bad)}; regenerate it with "
            "`dynpipe profile`"
        )
    phases = set(df["phase"].unique()) - set(_PHASES)
    if phases:
        raise UserError(
            f"{source} has phase value(s) {', '.join(sorted(map(str, phases)))}; "
            "phase must be 'fwd' or 'bwd'"
        )


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``dynpipe`` provenance JSON of one dataset file."""
    import pyarrow.parquet as pq

    path = Path(path)
    try:
        raw = pq.read_schema(path).metadata or {}
    except FileNotFoundError:
        raise UserError(
            f"profile dataset {path} does not exist; produce one with "
            "`dynpipe profile --model MODEL --sweep recipes/sweeps/cpu.toml -o " + str(path) + "`"
        ) from None
    except Exception as exc:  # pyarrow raises several types for a corrupt file
        raise UserError(
            f"{path} is not a readable parquet file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else 'unreadable'}); re-run `dynpipe profile`"
        ) from None
    blob = raw.get(META_KEY.encode())
    if blob is None:
        raise UserError(
            f"{path} has no '{META_KEY}' metadata, so it was not written by `dynpipe profile`; "
            "regenerate it with `dynpipe profile`"
        )
    try:
        meta = json.loads(blob)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{path} has corrupt '{META_KEY}' metadata ({exc}); regenerate it"
        ) from None
    version = meta.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{path} is profile schema v{version} but this dynpipe reads v{SCHEMA_VERSION}; "
            "regenerate it with `dynpipe profile`"
        )
    absent = [k for k in _REQUIRED_META if k not in meta]
    if absent:
        raise UserError(
            f"{path} metadata lacks {', '.join(absent)}; regenerate it with `dynpipe profile`"
        )
    return meta


def _expand(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]]) -> list[Path]:
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(p.glob("*.parquet"))
            if not found:
                raise UserError(f"directory {p} holds no *.parquet profile datasets")
            out.extend(found)
        else:
            out.append(p)
    if not out:
        raise UserError("no profile datasets given; pass one or more .parquet files")
    return out


def load_profiles(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
) -> pd.DataFrame:
    """Read and validate datasets (files or directories of them) into one frame.

    Each file's provenance is kept in ``df.attrs["dynpipe"]`` (a list, one entry per file,
    each with its ``path``).
    """
    import pandas as pd

    frames = []
    metas = []
    for path in _expand(paths):
        meta = read_metadata(path)
        df = pd.read_parquet(path)
        validate_frame(df, source=str(path))
        frames.append(df)
        metas.append({**meta, "path": str(path)})
    out = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
    out.attrs[META_KEY] = metas
    return out


def write_profiles(
    df: pd.DataFrame, path: str | os.PathLike[str], *, meta: Mapping[str, Any]
) -> None:
    """Validate and write ``df`` atomically, with ``meta`` as the provenance JSON."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    validate_frame(df, source="profile rows")
    meta = {**meta, "schema_version": SCHEMA_VERSION}
    absent = [k for k in _REQUIRED_META if k not in meta]
    assert not absent, f"writer forgot metadata {absent}"
    table = pa.Table.from_pandas(df, preserve_index=False)
    extra = {META_KEY.encode(): json.dumps(meta, sort_keys=True).encode()}
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), **extra})
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pq.write_table(table, tmp)
    # Rename is atomic: an interrupted sweep leaves the previous complete file, so it resumes.
    os.replace(tmp, path)
