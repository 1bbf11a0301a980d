// The ring ABI, C view. The Python view is dpu_offload/abi.py; tests/test_abi.py compiles this
// header with a host C compiler and proves every size, offset and constant identical.
// Plain C structs so that both nvcc/NVRTC and a host compiler accept it.
#ifndef DPU_OFFLOAD_RING_CUH
#define DPU_OFFLOAD_RING_CUH

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#endif

#define DPU_RING_MAGIC 0x52555044u
#define DPU_ABI_VERSION 4u
#define DPU_HEADER_BYTES 256
#define DPU_CACHE_LINE_BYTES 64
#define DPU_COPY_ALIGN_BYTES 16
#define DPU_MAX_REGIONS 64

#define DPU_RING_WORK 1u
#define DPU_RING_COMPLETION 2u
#define DPU_RING_RX_PACKET 3u
#define DPU_RING_TX_PACKET 4u
#define DPU_RING_REQUEST 5u

#define DPU_OP_NOP 0u
#define DPU_OP_COPY 1u
#define DPU_OP_PACKET 2u
#define DPU_OP_FENCE 3u
#define DPU_OP_EXIT 4u
#define DPU_OP_SIGNAL 5u

#define DPU_STATUS_OK 0u
#define DPU_STATUS_CHECKSUM_MISMATCH 1u
#define DPU_STATUS_OUT_OF_BOUNDS 2u
#define DPU_STATUS_BAD_OPCODE 3u
#define DPU_STATUS_BAD_ALIGNMENT 4u
#define DPU_STATUS_BAD_REGION 5u
#define DPU_STATUS_BAD_RING 6u
#define DPU_STATUS_CANCELLED 7u

#define DPU_DESC_VERIFY 1u
#define DPU_REPLY_RESIDENT 1u
#define DPU_REPLY_PIN_HELD 2u
#define DPU_REGION_READABLE 1u
#define DPU_REGION_WRITABLE 2u
#define DPU_PACKET_LAST 1u
#define DPU_PACKET_ERROR 2u
#define DPU_SLOT_OFFSET_BITS 48  // a packet's slot: region id << this | byte offset

#define DPU_MAX_CHANNEL_SLOTS 16384
#define DPU_SLOT_STATE_BITS 8
#define DPU_REQ_ACQUIRE 1u
#define DPU_REQ_RELEASE 2u
#define DPU_REQ_PREFETCH 3u
#define DPU_REQ_ROUTE 4u
#define DPU_REQFLAG_LAST 1u
#define DPU_MAX_ROUTE_COUNT 1048576u
#define DPU_SLOT_FREE 0u
#define DPU_SLOT_FILLING 1u
#define DPU_SLOT_READY 2u
#define DPU_SLOT_FAILED 3u
#define DPU_SLOT_LANDED 4u
#define DPU_SLOT_EVICTING 5u  // the agent is about to reuse the slot (pinned hits)
#define DPU_REQSTATUS_OK 0u
#define DPU_REQSTATUS_BAD_OPCODE 1u
#define DPU_REQSTATUS_INVALID_ARGUMENT 2u
#define DPU_REQSTATUS_NOT_FOUND 3u
#define DPU_REQSTATUS_ALREADY_EXISTS 4u
#define DPU_REQSTATUS_FAILED_PRECONDITION 5u
#define DPU_REQSTATUS_PERMISSION_DENIED 6u
#define DPU_REQSTATUS_RESOURCE_EXHAUSTED 7u
#define DPU_REQSTATUS_UNAVAILABLE 8u
#define DPU_REQSTATUS_REQUEST_REUSED 9u

typedef struct {
    uint32_t magic;
    uint32_t version;
    uint32_t kind;
    uint32_t entry_size;
    uint32_t capacity;
    uint32_t exit_flag;
    uint32_t fault;
    uint8_t pad0[64 - 28];
    uint64_t producer;
    uint32_t pad1;
    uint32_t doorbell;
    uint64_t sleepers;
    uint8_t pad2[64 - 24];
    uint64_t consumer;
    uint8_t pad3[128 - 8];
} dpu_ring_header;

typedef struct {
    uint64_t transfer_id;
    uint16_t opcode;
    uint16_t flags;
    uint32_t chunk_index;
    uint32_t chunk_count;
    uint32_t src_region;
    uint64_t src_offset;  // DPU_OP_SIGNAL: the slot-state word to write
    uint32_t dst_region;
    uint32_t checksum;
    uint64_t dst_offset;
    uint32_t length;
    uint32_t position;
    uint64_t seq;
} dpu_descriptor;

typedef struct {
    uint64_t transfer_id;
    uint32_t chunk_index;
    uint32_t status;
    uint64_t nbytes;
    uint64_t seq;
} dpu_completion;

typedef struct {
    uint64_t base;
    uint64_t size;
    uint32_t flags;
    uint32_t generation;
    uint64_t reserved;
} dpu_region;

typedef struct {
    uint64_t message_id;
    uint64_t offset;
    uint32_t length;
    uint32_t flags;
    uint32_t checksum;
    uint16_t layer;
    uint16_t expert;
    uint32_t model;
    uint32_t status;        // tx, with DPU_PACKET_ERROR: the FrameStatus
    uint64_t total_length;
    uint64_t slot;          // rx: region id << 48 | the expert slot's byte offset
    uint64_t seq;
} dpu_packet_header;

// The data-plane channel (docs/ABI.md): request ring entries, reply table, slot states.
typedef struct {
    uint64_t request_id;
    uint16_t opcode;
    uint16_t flags;
    uint32_t model;
    uint32_t layer;
    uint32_t expert;
    uint64_t posted_ns;  // the client's CLOCK_MONOTONIC at posting: a diagnostic only
    uint32_t count;      // ROUTE: tokens that chose the expert
    uint16_t prefetch;   // ROUTE, last entry of a visit: next-layer experts to prefetch
    uint8_t reserved[56 - 38];
    uint64_t seq;
} dpu_request;

typedef struct {
    uint64_t request_id;
    uint32_t status;
    uint32_t region_id;
    uint32_t slot_index;
    uint32_t state_index;
    uint64_t generation;
    uint64_t slot_offset;
    char message[76];
    uint32_t flags;
    uint64_t seq;
} dpu_reply;

typedef struct {
    uint64_t word;
    uint32_t status;
    uint32_t expected;
} dpu_slot_state;

// One slot of a batch check (dpu_verify_granted_batch), in host memory the device maps,
// written when the ACQUIREs are posted: the reply entry to wait for and its seq once answered,
// the slot-state table, the blob's 16-byte vectors. The client writes it, only its kernels read it.
typedef struct {
    uint64_t reply;
    uint64_t seq;
    uint64_t states;
    uint64_t n16;
} dpu_slot_check;

// Written by the client only (pinned hits); no kernel reads it.
typedef struct {
    uint32_t pins;
    uint32_t touches;
} dpu_pin;

#ifdef __CUDACC__
// Checksum of 32-bit little-endian words w[i] whose global word index is g = offset / 4 + i:
// sum over i of fmix32(w[i] ^ (g * 0x9E3779B1)), mod 2^32, then xor the word count.
// Order-independent, so any thread partition gives the same result; see checksum.py.
__device__ __forceinline__ uint32_t dpu_fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85ebca6bu;
    h ^= h >> 13;
    h *= 0xc2b2ae35u;
    h ^= h >> 16;
    return h;
}

__device__ __forceinline__ uint32_t dpu_word_term(uint32_t w, uint64_t global_word) {
    return dpu_fmix32(w ^ ((uint32_t)global_word * 0x9E3779B1u));
}

// The checksum of `bytes` bytes from their sum of terms (the word count xored in; the same
// step takes a checksum back to its sum). checksum.finish is its twin.
__device__ __forceinline__ uint32_t dpu_checksum_finish(uint32_t terms, uint64_t bytes) {
    return terms ^ (uint32_t)(bytes / 4);
}

__device__ __forceinline__ uint32_t dpu_vec_terms(uint4 v, uint64_t global_word) {
    return dpu_word_term(v.x, global_word) + dpu_word_term(v.y, global_word + 1) +
           dpu_word_term(v.z, global_word + 2) + dpu_word_term(v.w, global_word + 3);
}

// Sum of v over the block; the result is valid in thread 0. scratch: 32 words of shared memory.
// Every thread of the block must call it (it synchronises the block).
__device__ __forceinline__ uint32_t dpu_block_sum(uint32_t v, uint32_t* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    uint32_t total = 0;
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)((blockDim.x + 31) >> 5); ++w) total += scratch[w];
    return total;
}

__device__ __forceinline__ uint64_t dpu_load_volatile_u64(const uint64_t* p) {
    return *(const volatile uint64_t*)p;
}

__device__ __forceinline__ uint32_t dpu_load_volatile_u32(const uint32_t* p) {
    return *(const volatile uint32_t*)p;
}
#endif

#endif  // DPU_OFFLOAD_RING_CUH
