from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_KIND_CUDA: _ClassVar[DeviceKind]
    DEVICE_KIND_CPU_REFERENCE: _ClassVar[DeviceKind]

class Delivery(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DELIVERY_DEVICE_PULL: _ClassVar[Delivery]
    DELIVERY_DMA_ENGINE: _ClassVar[Delivery]

class RegionKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REGION_KIND_UNSPECIFIED: _ClassVar[RegionKind]
    REGION_KIND_SLOT_POOL: _ClassVar[RegionKind]
    REGION_KIND_WORK_RING: _ClassVar[RegionKind]
    REGION_KIND_COMPLETION_RING: _ClassVar[RegionKind]
    REGION_KIND_RX_RING: _ClassVar[RegionKind]
    REGION_KIND_TX_RING: _ClassVar[RegionKind]

class ExpertActivation(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPERT_ACTIVATION_SWIGLU: _ClassVar[ExpertActivation]
    EXPERT_ACTIVATION_CLAMPED_SWIGLU: _ClassVar[ExpertActivation]

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_UNSPECIFIED: _ClassVar[SlotState]
    SLOT_STATE_FILLING: _ClassVar[SlotState]
    SLOT_STATE_READY: _ClassVar[SlotState]
DEVICE_KIND_UNSPECIFIED: DeviceKind
DEVICE_KIND_CUDA: DeviceKind
DEVICE_KIND_CPU_REFERENCE: DeviceKind
DELIVERY_DEVICE_PULL: Delivery
DELIVERY_DMA_ENGINE: Delivery
REGION_KIND_UNSPECIFIED: RegionKind
REGION_KIND_SLOT_POOL: RegionKind
REGION_KIND_WORK_RING: RegionKind
REGION_KIND_COMPLETION_RING: RegionKind
REGION_KIND_RX_RING: RegionKind
REGION_KIND_TX_RING: RegionKind
EXPERT_ACTIVATION_SWIGLU: ExpertActivation
EXPERT_ACTIVATION_CLAMPED_SWIGLU: ExpertActivation
SLOT_STATE_UNSPECIFIED: SlotState
SLOT_STATE_FILLING: SlotState
SLOT_STATE_READY: SlotState

class ExpertKey(_message.Message):
    __slots__ = ("model", "layer", "expert")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    model: str
    layer: int
    expert: int
    def __init__(self, model: _Optional[str] = ..., layer: _Optional[int] = ..., expert: _Optional[int] = ...) -> None: ...

class CreateSessionRequest(_message.Message):
    __slots__ = ("client_name", "lease_seconds")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    lease_seconds: int
    def __init__(self, client_name: _Optional[str] = ..., lease_seconds: _Optional[int] = ...) -> None: ...

class ArenaInfo(_message.Message):
    __slots__ = ("shm_name", "size_bytes", "region_id")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size_bytes: int
    region_id: int
    def __init__(self, shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., region_id: _Optional[int] = ...) -> None: ...

class CreateSessionResponse(_message.Message):
    __slots__ = ("session_id", "lease_seconds", "arena", "activations_port", "session_token", "bell_shm_name", "shm_gid")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    ACTIVATIONS_PORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BELL_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SHM_GID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lease_seconds: int
    arena: ArenaInfo
    activations_port: int
    session_token: str
    bell_shm_name: str
    shm_gid: int
    def __init__(self, session_id: _Optional[str] = ..., lease_seconds: _Optional[int] = ..., arena: _Optional[_Union[ArenaInfo, _Mapping]] = ..., activations_port: _Optional[int] = ..., session_token: _Optional[str] = ..., bell_shm_name: _Optional[str] = ..., shm_gid: _Optional[int] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterDeviceRequest(_message.Message):
    __slots__ = ("session_id", "kind", "ordinal", "name", "memory_bytes", "delivery")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ORDINAL_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DELIVERY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    kind: DeviceKind
    ordinal: int
    name: str
    memory_bytes: int
    delivery: Delivery
    def __init__(self, session_id: _Optional[str] = ..., kind: _Optional[_Union[DeviceKind, str]] = ..., ordinal: _Optional[int] = ..., name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., delivery: _Optional[_Union[Delivery, str]] = ...) -> None: ...

class ChannelInfo(_message.Message):
    __slots__ = ("shm_name", "size_bytes", "capacity")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    size_bytes: int
    capacity: int
    def __init__(self, shm_name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class RegisterDeviceResponse(_message.Message):
    __slots__ = ("device_id", "channel")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    CHANNEL_FIELD_NUMBER: _ClassVar[int]
    device_id: int
    channel: ChannelInfo
    def __init__(self, device_id: _Optional[int] = ..., channel: _Optional[_Union[ChannelInfo, _Mapping]] = ...) -> None: ...

class ServeActivationsRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "serve")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SERVE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    serve: bool
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., serve: _Optional[bool] = ...) -> None: ...

class LinkPeersRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "sources")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    sources: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., sources: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRegionRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "kind", "size_bytes", "shm_name", "cuda_ipc_handle", "slot_bytes", "slot_count", "home_layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    HOME_LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    kind: RegionKind
    size_bytes: int
    shm_name: str
    cuda_ipc_handle: bytes
    slot_bytes: int
    slot_count: int
    home_layers: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., kind: _Optional[_Union[RegionKind, str]] = ..., size_bytes: _Optional[int] = ..., shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ..., home_layers: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRegionResponse(_message.Message):
    __slots__ = ("region_id",)
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    region_id: int
    def __init__(self, region_id: _Optional[int] = ...) -> None: ...

class RegionRef(_message.Message):
    __slots__ = ("session_id", "region_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    region_id: int
    def __init__(self, session_id: _Optional[str] = ..., region_id: _Optional[int] = ...) -> None: ...

class DeviceRef(_message.Message):
    __slots__ = ("session_id", "device_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("path", "name")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    path: str
    name: str
    def __init__(self, path: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "offset", "nbytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    offset: int
    nbytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., offset: _Optional[int] = ..., nbytes: _Optional[int] = ...) -> None: ...

class ExpertManifest(_message.Message):
    __slots__ = ("key", "blob_bytes", "chunk_bytes", "tensors", "chunk_checksums", "activation", "swiglu_alpha", "swiglu_limit")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BLOB_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    SWIGLU_ALPHA_FIELD_NUMBER: _ClassVar[int]
    SWIGLU_LIMIT_FIELD_NUMBER: _ClassVar[int]
    key: ExpertKey
    blob_bytes: int
    chunk_bytes: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    chunk_checksums: _containers.RepeatedScalarFieldContainer[int]
    activation: ExpertActivation
    swiglu_alpha: float
    swiglu_limit: float
    def __init__(self, key: _Optional[_Union[ExpertKey, _Mapping]] = ..., blob_bytes: _Optional[int] = ..., chunk_bytes: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., chunk_checksums: _Optional[_Iterable[int]] = ..., activation: _Optional[_Union[ExpertActivation, str]] = ..., swiglu_alpha: _Optional[float] = ..., swiglu_limit: _Optional[float] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model", "architecture", "moe_layers", "experts_per_layer", "expert_bytes", "total_expert_bytes", "model_index")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_EXPERT_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODEL_INDEX_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    experts_per_layer: int
    expert_bytes: int
    total_expert_bytes: int
    model_index: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., moe_layers: _Optional[_Iterable[int]] = ..., experts_per_layer: _Optional[int] = ..., expert_bytes: _Optional[int] = ..., total_expert_bytes: _Optional[int] = ..., model_index: _Optional[int] = ...) -> None: ...

class DescribeExpertsRequest(_message.Message):
    __slots__ = ("session_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    keys: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    def __init__(self, session_id: _Optional[str] = ..., keys: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ...) -> None: ...

class DescribeExpertsResponse(_message.Message):
    __slots__ = ("manifests",)
    MANIFESTS_FIELD_NUMBER: _ClassVar[int]
    manifests: _containers.RepeatedCompositeFieldContainer[ExpertManifest]
    def __init__(self, manifests: _Optional[_Iterable[_Union[ExpertManifest, _Mapping]]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    key: ExpertKey
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., key: _Optional[_Union[ExpertKey, _Mapping]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("transfer_id", "region_id", "slot_index", "slot_offset", "state", "manifest", "state_index", "generation")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REGION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_INDEX_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    STATE_INDEX_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    transfer_id: int
    region_id: int
    slot_index: int
    slot_offset: int
    state: SlotState
    manifest: ExpertManifest
    state_index: int
    generation: int
    def __init__(self, transfer_id: _Optional[int] = ..., region_id: _Optional[int] = ..., slot_index: _Optional[int] = ..., slot_offset: _Optional[int] = ..., state: _Optional[_Union[SlotState, str]] = ..., manifest: _Optional[_Union[ExpertManifest, _Mapping]] = ..., state_index: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class AcquireBatchRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    keys: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ...) -> None: ...

class AcquireBatchResponse(_message.Message):
    __slots__ = ("slots",)
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    slots: _containers.RepeatedCompositeFieldContainer[AcquireResponse]
    def __init__(self, slots: _Optional[_Iterable[_Union[AcquireResponse, _Mapping]]] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    keys: _containers.RepeatedCompositeFieldContainer[ExpertKey]
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[ExpertKey, _Mapping]]] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("scheduled",)
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    scheduled: int
    def __init__(self, scheduled: _Optional[int] = ...) -> None: ...

class DeviceList(_message.Message):
    __slots__ = ("device_ids",)
    DEVICE_IDS_FIELD_NUMBER: _ClassVar[int]
    device_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, device_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class LayerPlacement(_message.Message):
    __slots__ = ("experts",)
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    experts: _containers.RepeatedCompositeFieldContainer[DeviceList]
    def __init__(self, experts: _Optional[_Iterable[_Union[DeviceList, _Mapping]]] = ...) -> None: ...

class ApplyPlacementRequest(_message.Message):
    __slots__ = ("session_id", "model", "layers")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ...) -> None: ...

class ApplyPlacementResponse(_message.Message):
    __slots__ = ("placement_id", "copies_to_add", "copies_to_drop")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    COPIES_TO_ADD_FIELD_NUMBER: _ClassVar[int]
    COPIES_TO_DROP_FIELD_NUMBER: _ClassVar[int]
    placement_id: int
    copies_to_add: int
    copies_to_drop: int
    def __init__(self, placement_id: _Optional[int] = ..., copies_to_add: _Optional[int] = ..., copies_to_drop: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("session_id", "model", "replicas")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    replicas: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., replicas: _Optional[int] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("placement_id", "max_load_ratio", "bytes_moved", "copies_to_add", "copies_to_drop")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_LOAD_RATIO_FIELD_NUMBER: _ClassVar[int]
    BYTES_MOVED_FIELD_NUMBER: _ClassVar[int]
    COPIES_TO_ADD_FIELD_NUMBER: _ClassVar[int]
    COPIES_TO_DROP_FIELD_NUMBER: _ClassVar[int]
    placement_id: int
    max_load_ratio: float
    bytes_moved: int
    copies_to_add: int
    copies_to_drop: int
    def __init__(self, placement_id: _Optional[int] = ..., max_load_ratio: _Optional[float] = ..., bytes_moved: _Optional[int] = ..., copies_to_add: _Optional[int] = ..., copies_to_drop: _Optional[int] = ...) -> None: ...

class PlacementProgress(_message.Message):
    __slots__ = ("placement_id", "model", "done", "failed", "total", "dropped")
    PLACEMENT_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    placement_id: int
    model: str
    done: int
    failed: int
    total: int
    dropped: int
    def __init__(self, placement_id: _Optional[int] = ..., model: _Optional[str] = ..., done: _Optional[int] = ..., failed: _Optional[int] = ..., total: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id", "device_id", "key")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    device_id: int
    key: ExpertKey
    def __init__(self, session_id: _Optional[str] = ..., device_id: _Optional[int] = ..., key: _Optional[_Union[ExpertKey, _Mapping]] = ...) -> None: ...

class Event(_message.Message):
    __slots__ = ("error", "placement_progress")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_PROGRESS_FIELD_NUMBER: _ClassVar[int]
    error: str
    placement_progress: PlacementProgress
    def __init__(self, error: _Optional[str] = ..., placement_progress: _Optional[_Union[PlacementProgress, _Mapping]] = ...) -> None: ...

class RoutingStep(_message.Message):
    __slots__ = ("layer", "experts", "tokens")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportRoutingRequest(_message.Message):
    __slots__ = ("session_id", "model", "steps", "prefetch_top_k", "prefetch_device_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_TOP_K_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model: str
    steps: _containers.RepeatedCompositeFieldContainer[RoutingStep]
    prefetch_top_k: int
    prefetch_device_id: int
    def __init__(self, session_id: _Optional[str] = ..., model: _Optional[str] = ..., steps: _Optional[_Iterable[_Union[RoutingStep, _Mapping]]] = ..., prefetch_top_k: _Optional[int] = ..., prefetch_device_id: _Optional[int] = ...) -> None: ...

class FlowRule(_message.Message):
    __slots__ = ("rule_id", "traffic", "action", "model", "layer_min", "layer_max", "expert", "source", "queues", "priority", "origin", "packets", "bytes")
    RULE_ID_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYER_MIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_MAX_FIELD_NUMBER: _ClassVar[int]
    EXPERT_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    PACKETS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    rule_id: int
    traffic: str
    action: str
    model: str
    layer_min: int
    layer_max: int
    expert: int
    source: str
    queues: _containers.RepeatedScalarFieldContainer[int]
    priority: int
    origin: str
    packets: int
    bytes: int
    def __init__(self, rule_id: _Optional[int] = ..., traffic: _Optional[str] = ..., action: _Optional[str] = ..., model: _Optional[str] = ..., layer_min: _Optional[int] = ..., layer_max: _Optional[int] = ..., expert: _Optional[int] = ..., source: _Optional[str] = ..., queues: _Optional[_Iterable[int]] = ..., priority: _Optional[int] = ..., origin: _Optional[str] = ..., packets: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class ApplyFlowsRequest(_message.Message):
    __slots__ = ("session_id", "add", "delete")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    DELETE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    add: _containers.RepeatedCompositeFieldContainer[FlowRule]
    delete: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., add: _Optional[_Iterable[_Union[FlowRule, _Mapping]]] = ..., delete: _Optional[_Iterable[int]] = ...) -> None: ...

class ApplyFlowsResponse(_message.Message):
    __slots__ = ("version", "added")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    version: int
    added: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, version: _Optional[int] = ..., added: _Optional[_Iterable[int]] = ...) -> None: ...

class ListFlowsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListFlowsResponse(_message.Message):
    __slots__ = ("version", "rules", "lookups", "misses")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    version: int
    rules: _containers.RepeatedCompositeFieldContainer[FlowRule]
    lookups: int
    misses: int
    def __init__(self, version: _Optional[int] = ..., rules: _Optional[_Iterable[_Union[FlowRule, _Mapping]]] = ..., lookups: _Optional[int] = ..., misses: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SessionStatus(_message.Message):
    __slots__ = ("session_id", "client_name", "devices", "regions", "slots_ready", "lease_remaining_seconds", "slots_held")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_READY_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SLOTS_HELD_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    client_name: str
    devices: int
    regions: int
    slots_ready: int
    lease_remaining_seconds: float
    slots_held: int
    def __init__(self, session_id: _Optional[str] = ..., client_name: _Optional[str] = ..., devices: _Optional[int] = ..., regions: _Optional[int] = ..., slots_ready: _Optional[int] = ..., lease_remaining_seconds: _Optional[float] = ..., slots_held: _Optional[int] = ...) -> None: ...

class ModelStatus(_message.Message):
    __slots__ = ("model", "architecture", "experts", "model_index", "degraded", "manifest")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_INDEX_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    experts: int
    model_index: int
    degraded: str
    manifest: bool
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., experts: _Optional[int] = ..., model_index: _Optional[int] = ..., degraded: _Optional[str] = ..., manifest: _Optional[bool] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("version", "uptime_seconds", "sessions", "models", "arena_bytes", "arena_used_bytes", "experts_cached", "cache_hits", "cache_misses", "transfers_in_flight", "arena_pins", "other_sessions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_CACHED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ARENA_PINS_FIELD_NUMBER: _ClassVar[int]
    OTHER_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_seconds: float
    sessions: _containers.RepeatedCompositeFieldContainer[SessionStatus]
    models: _containers.RepeatedCompositeFieldContainer[ModelStatus]
    arena_bytes: int
    arena_used_bytes: int
    experts_cached: int
    cache_hits: int
    cache_misses: int
    transfers_in_flight: int
    arena_pins: int
    other_sessions: int
    def __init__(self, version: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., sessions: _Optional[_Iterable[_Union[SessionStatus, _Mapping]]] = ..., models: _Optional[_Iterable[_Union[ModelStatus, _Mapping]]] = ..., arena_bytes: _Optional[int] = ..., arena_used_bytes: _Optional[int] = ..., experts_cached: _Optional[int] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., transfers_in_flight: _Optional[int] = ..., arena_pins: _Optional[int] = ..., other_sessions: _Optional[int] = ...) -> None: ...
