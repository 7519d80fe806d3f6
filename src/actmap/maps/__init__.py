"""Maps: the operator Phi (a pooled trajectory -> an activation map) and its stored form.

operator    Phi, `build_maps` / `build_map`, the float16 `stored_form` (of a map) and
            `saturated_float16` (of a kept state), the pooling the
            capture hooks use (`pool_hidden`, `pool_layers`); re-exported here
ablations   the paper's ablation transforms (channel groups removed, last-token channels,
            permuted or projected coordinates, the mean-pooled final layer)
"""

from actmap.maps.operator import (
    CHANNELS,
    DENSE_LAYER_GROUPS,
    FINAL_WINDOW,
    FLOAT16_MAX,
    MAP_BYTES,
    MAP_SHAPE,
    SLOPE_EPS,
    STD_FLOOR,
    MapConfig,
    PadMode,
    all_channel_names,
    build_map,
    build_maps,
    build_maps_from_list,
    channel_names,
    map_shape,
    pad_trajectories,
    pool_hidden,
    pool_layers,
    saturated_float16,
    segment_bounds,
    segment_channel_names,
    stored_form,
    temporal_statistics,
)

__all__ = [
    "CHANNELS",
    "DENSE_LAYER_GROUPS",
    "FINAL_WINDOW",
    "FLOAT16_MAX",
    "MAP_BYTES",
    "MAP_SHAPE",
    "SLOPE_EPS",
    "STD_FLOOR",
    "MapConfig",
    "PadMode",
    "all_channel_names",
    "build_map",
    "build_maps",
    "build_maps_from_list",
    "channel_names",
    "map_shape",
    "pad_trajectories",
    "pool_hidden",
    "pool_layers",
    "saturated_float16",
    "segment_bounds",
    "segment_channel_names",
    "stored_form",
    "temporal_statistics",
]
