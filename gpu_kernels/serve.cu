// The resident receiver: one persistent kernel that serves the activations the NIC writes into
// a worker device's rx packet ring, with no host thread per message (the GPUNetIO pattern:
// the NIC fills the receive queue, a resident kernel consumes it). Twin: the NumPy receiver of
// host_client/worker.py (the ExpertWorker thread), same rules.
//
// Per part (the packets up to one flagged LAST, or up to another message's; docs/ABI.md): block
// 0's first thread waits for
// them all to be published, then every block lands its share of the packets in the message's
// input buffer, each checked (16-byte aligned, fits its entry, inside the buffer) and its
// checksum verified before a byte of it is written. The part must land every byte from where
// the last one ended to its end and end on a full packet or the message's end; else the
// message is answered BAD_CHECKSUM (the NIC writes it again). A whole message runs the SwiGLU
// FFN of the expert in the slot its packets name (the region id above DPU_SLOT_OFFSET_BITS, the
// offset below; the layout from models[model]: row-major SwiGLU with 16-byte loads, any strided
// SwiGLU, or gpt-oss's clamped SwiGLU with its biases) over tiles of FFN_MAX_ROWS rows, and its
// output goes into the tx ring as checksummed packets, a LAST every half ring; a message the
// kernel cannot serve (unknown model or region, a layout it does not compute, too large for its
// buffers) is answered with one ERROR packet. Blocks meet at a grid barrier between steps: launch at most one block per
// multiprocessor so that all are resident. rx_hdr->exit_flag ends it.
#include "ring.cuh"
#include "ffn.cuh"
#include "ffn_gemm.cuh"
#include "packets.cuh"
#include "serve_ffn.cuh"

#define SERVE_RECEIVE 1u
#define SERVE_FFN 2u
#define SERVE_ERROR 3u
#define SERVE_EXIT 4u
#define SERVE_NONE 5u
#define SERVE_NO_MESSAGE 0xFFFFFFFFFFFFFFFFull

// Frame statuses (dpu_offload/frames.py) the kernel answers with.
#define SERVE_WORKER_FAILED 7u
#define SERVE_BAD_CHECKSUM 8u

typedef struct {
    unsigned long long base;  // device address of the region (0: not a region of this device)
    unsigned long long size;  // bytes
} dpu_serve_region;

typedef struct {
    unsigned int barrier_count, barrier_gen, action, status;
    unsigned long long pos, part_n, nid, total, slot, done, first, end, tx_pos, answer;
    unsigned int model, layer, expert, whole, skip, reason;
    unsigned long long written, refused;
    unsigned long long served, failed, refused_packets;  // counters the host reads
} dpu_serve_ctl;

__device__ __forceinline__ volatile dpu_packet_header* serve_entry(unsigned char* entries,
                                                                   unsigned long long pos,
                                                                   unsigned long long cap,
                                                                   unsigned long long size) {
    return (volatile dpu_packet_header*)(entries + (pos & (cap - 1)) * size);
}

// All blocks meet here (sense by generation); memory before it is visible after it.
__device__ void serve_barrier(dpu_serve_ctl* c) {
    __syncthreads();
    if (threadIdx.x == 0) {
        volatile unsigned int* gen = &c->barrier_gen;
        const unsigned int g = *gen;
        __threadfence();
        if (atomicAdd(&c->barrier_count, 1u) == gridDim.x - 1) {
            c->barrier_count = 0;
            __threadfence();
            atomicAdd(&c->barrier_gen, 1u);
        } else {
            while (*gen == g) __nanosleep(64);
        }
        __threadfence();
    }
    __syncthreads();
}

// The first column this warp computes of row tile `tile` (columns `columns` wide) when the
// tiles' columns are dealt out to the warps in one sequence.
__device__ __forceinline__ int serve_tile_first(int warp, int n_warps, int tile, int columns) {
    const int shift = (int)(((long long)tile * columns) % n_warps);
    return (warp - shift + n_warps) % n_warps;
}

// Block 0, warp 0: wait for the next whole part (or the exit flag) and describe it in c. The
// lanes read 32 entries' seq, message id and flags at once (one PCIe round trip per window,
// not three per packet); lane 0 writes c. A part ends after a LAST packet, before another
// message's packet, or after a whole ring; entries past its end are read but never waited for.
__device__ void serve_find_part(dpu_ring_header* rx_hdr, unsigned char* rx, dpu_serve_ctl* c) {
    const unsigned long long cap = rx_hdr->capacity, size = rx_hdr->entry_size;
    const unsigned long long room = size - sizeof(dpu_packet_header);
    const unsigned long long pos = c->pos;
    const unsigned int lane = threadIdx.x & 31, all = 0xFFFFFFFFu;
    unsigned long long n = 0, first_id = 0;
    for (;;) {  // the window [n, n + 32)
        const unsigned long long k = n + lane;
        volatile dpu_packet_header* h = serve_entry(rx, pos + k, cap, size);
        unsigned long long end = 0;
        for (;;) {
            const bool published = k < cap && h->seq == pos + k + 1;
            __threadfence_system();
            const unsigned long long id = published ? h->message_id : 0;
            const bool last = published && (h->flags & DPU_PACKET_LAST);
            const unsigned int ready = __ballot_sync(all, published);
            const unsigned int prefix = ready == all ? 32u : __ffs(~ready) - 1;  // lanes in a row
            if (n == 0 && prefix > 0) first_id = __shfl_sync(all, id, 0);
            const unsigned int in_prefix = prefix == 32 ? all : (1u << prefix) - 1;
            const unsigned int other = __ballot_sync(all, published && id != first_id) & in_prefix;
            const unsigned int lasts = __ballot_sync(all, last) & in_prefix;
            const unsigned long long at_other = other ? n + __ffs(other) - 1 : ~0ull;
            const unsigned long long after_last = lasts ? n + __ffs(lasts) : ~0ull;
            end = min(at_other, after_last);
            if (end != ~0ull || n + prefix >= cap) {
                end = min(end, cap);
                break;
            }
            if (prefix == 32) break;  // no end in this window: the next one
            if (dpu_load_volatile_u32(&rx_hdr->exit_flag)) {
                if (lane == 0) c->action = SERVE_EXIT;
                return;
            }
            __nanosleep(128);
        }
        if (end != 0 && end != ~0ull) { n = end; break; }
        n += 32;
    }
    if (lane != 0) return;
    volatile dpu_packet_header* first = serve_entry(rx, pos, cap, size);
    volatile dpu_packet_header* last = serve_entry(rx, pos + n - 1, cap, size);
    c->part_n = n;
    c->first = first->offset;
    c->end = last->offset + last->length;
    c->whole = last->length == room;
    c->written = c->refused = 0;
    c->skip = 0;
    const unsigned long long nid = first->message_id;
    if (nid != c->nid) {
        if (first->offset == 0) {  // a new message
            c->nid = nid;
            c->done = 0;
            c->total = first->total_length;
            c->slot = first->slot;
            c->model = first->model;
            c->layer = first->layer;
            c->expert = first->expert;
        } else {
            c->skip = 1;  // the rest of a message already answered
        }
    }
    c->action = SERVE_RECEIVE;
}

// Every block: land the part's packets (block b takes packets b, b + gridDim.x, ...).
__device__ void serve_receive(dpu_ring_header* rx_hdr, unsigned char* rx, dpu_serve_ctl* c,
                              uint4* dst, unsigned long long dst_bytes, uint32_t* scratch) {
    __shared__ unsigned long long offset, length;
    __shared__ uint32_t checksum;
    __shared__ unsigned int sane, good;
    const unsigned long long cap = rx_hdr->capacity, size = rx_hdr->entry_size;
    const unsigned long long room = size - sizeof(dpu_packet_header);
    if (c->skip) return;
    for (unsigned long long p = blockIdx.x; p < c->part_n; p += gridDim.x) {
        const unsigned char* entry = rx + ((c->pos + p) & (cap - 1)) * size;
        if (threadIdx.x == 0) {
            const volatile dpu_packet_header* h = (const volatile dpu_packet_header*)entry;
            offset = h->offset;
            length = h->length;
            checksum = h->checksum;
            sane = h->message_id == c->nid && length <= room && length % 16 == 0 &&
                   offset % 16 == 0 && offset <= dst_bytes && length <= dst_bytes - offset;
        }
        __syncthreads();
        const uint4* src = (const uint4*)(entry + sizeof(dpu_packet_header));
        const unsigned long long n16 = sane ? length / 16 : 0;
        uint32_t sum = 0;
        for (unsigned long long i = threadIdx.x; i < n16; i += blockDim.x)
            sum += dpu_vec_terms(src[i], offset / 4 + 4 * i);
        const uint32_t total = dpu_block_sum(sum, scratch);
        if (threadIdx.x == 0) {
            good = sane && dpu_checksum_finish(total, length) == checksum;
            if (good) atomicAdd(&c->written, length);
            else atomicAdd(&c->refused, 1ull);
        }
        __syncthreads();
        if (good) {
            uint4* to = dst + offset / 16;
            for (unsigned long long i = threadIdx.x; i < n16; i += blockDim.x) to[i] = src[i];
        }
        __syncthreads();
    }
}

// Block 0, thread 0: take the part up (consumer advanced) and decide what the message needs.
__device__ void serve_decide(dpu_ring_header* rx_hdr, const dpu_serve_region* regions,
                             const dpu_serve_model* models, unsigned int n_models,
                             unsigned long long in_cap, unsigned long long h_cap,
                             dpu_serve_ctl* c) {
    c->pos += c->part_n;
    __threadfence_system();
    *(volatile unsigned long long*)&rx_hdr->consumer = c->pos;
    c->refused_packets += c->refused;
    c->action = SERVE_NONE;
    if (c->skip) return;
    const bool ok = c->refused == 0 && c->first == c->done && c->written == c->end - c->first &&
                    (c->whole || c->end == c->total) && c->total <= in_cap;
    c->answer = c->nid;
    if (!ok) {
        c->action = SERVE_ERROR;
        c->status = c->total > in_cap ? SERVE_WORKER_FAILED : SERVE_BAD_CHECKSUM;
        c->reason = c->total > in_cap ? 1u : 0u;
        c->nid = SERVE_NO_MESSAGE;  // a part of it that follows is skipped
        return;
    }
    c->done += c->written;
    if (c->done < c->total) return;
    c->nid = SERVE_NO_MESSAGE;  // whole: answered below
    const unsigned int region = (unsigned int)(c->slot >> DPU_SLOT_OFFSET_BITS);
    const unsigned long long offset = c->slot & ((1ull << DPU_SLOT_OFFSET_BITS) - 1);
    c->status = SERVE_WORKER_FAILED;
    c->action = SERVE_ERROR;
    if (c->model >= n_models || !models[c->model].kind) { c->reason = 2u; return; }
    const dpu_serve_model m = models[c->model];
    if (region >= DPU_MAX_REGIONS || regions[region].base == 0 ||
        offset > regions[region].size || m.blob_bytes > regions[region].size - offset) {
        c->reason = 3u;
        return;
    }
    const unsigned long long rows = c->total / (2ull * m.hidden);
    if (c->total % (2ull * m.hidden) || rows * m.inter > h_cap) { c->reason = 4u; return; }
    c->action = SERVE_FFN;
}

// Every block: packetize `nbytes` of `src` (the answer to c->answer) into the tx ring from
// c->tx_pos, LAST at the end of every part (abi.part_limit: half the ring) and on the last
// packet; returns the packets written.
__device__ unsigned long long serve_send(dpu_ring_header* tx_hdr, unsigned char* tx,
                                         const unsigned char* src, unsigned long long nbytes,
                                         dpu_serve_ctl* c, unsigned int flags,
                                         unsigned int status, uint32_t* scratch) {
    const unsigned long long cap = tx_hdr->capacity;
    const unsigned long long part = cap > 1 ? cap / 2 : 1;  // abi.part_limit
    const unsigned long long room = tx_hdr->entry_size - sizeof(dpu_packet_header);
    const unsigned long long packets = nbytes ? (nbytes + room - 1) / room : 1;
    for (unsigned long long p = blockIdx.x; p < packets; p += gridDim.x) {
        const unsigned long long offset = p * room;
        const unsigned long long len = nbytes ? min(room, nbytes - offset) : 0;
        const bool last = p + 1 == packets || (p + 1) % part == 0;
        const dpu_packet_fields f = {c->answer, nbytes, flags | (last ? DPU_PACKET_LAST : 0u),
                                     status, c->model, c->layer, c->expert, 0ull};
        dpu_put_packet(tx_hdr, tx, c->tx_pos + p, (const uint4*)(src + offset), offset, len, f,
                       scratch);
    }
    return packets;
}

// Why a message was refused, as the ERROR packet's payload (c->reason indexes it).
__constant__ char SERVE_REASONS[5][64] = {
    "packets failed their checksum or left a hole",
    "the message exceeds the resident receiver's buffers",
    "the model is not loaded or its layout is not computed here",
    "the packets name no slot of this device",
    "the rows do not fit the model's hidden size or the buffers"};

extern "C" __global__ void dpu_serve(dpu_ring_header* rx_hdr, unsigned char* rx,
                                     dpu_ring_header* tx_hdr, unsigned char* tx,
                                     const dpu_serve_region* __restrict__ regions,
                                     const dpu_serve_model* __restrict__ models,
                                     unsigned int n_models, uint4* inbuf,
                                     unsigned long long in_cap, float* hbuf,
                                     unsigned long long h_cap, unsigned short* outbuf,
                                     unsigned char* reason, dpu_serve_ctl* c) {
    __shared__ uint32_t scratch[32];
    const bool leader = blockIdx.x == 0 && threadIdx.x == 0;
    const int warps = blockDim.x >> 5;
    const int warp = blockIdx.x * warps + (threadIdx.x >> 5), n_warps = gridDim.x * warps;
    for (;;) {
        if (blockIdx.x == 0 && threadIdx.x < 32) serve_find_part(rx_hdr, rx, c);
        serve_barrier(c);
        if (c->action == SERVE_EXIT) return;
        serve_receive(rx_hdr, rx, c, inbuf, min(c->total, in_cap), scratch);
        serve_barrier(c);
        if (leader) serve_decide(rx_hdr, regions, models, n_models, in_cap, h_cap, c);
        serve_barrier(c);
        const unsigned int action = c->action;
        if (action == SERVE_FFN) {
            const dpu_serve_model m = models[c->model];
            const unsigned char* blob =
                (const unsigned char*)regions[c->slot >> DPU_SLOT_OFFSET_BITS].base +
                (c->slot & ((1ull << DPU_SLOT_OFFSET_BITS) - 1));
            const int rows = (int)(c->total / (2ull * m.hidden));
            const int hidden8 = m.hidden / 8, inter8 = m.inter / 8;
            const bool fast = m.kind == SERVE_CONTIGUOUS;
            const bool gemm = fast && rows >= SERVE_GEMM_ROWS && blockDim.x == 256;
            if (gemm)
                serve_gate_up_gemm((const unsigned short*)inbuf,
                                   (const unsigned short*)(blob + m.gate),
                                   (const unsigned short*)(blob + m.up), hbuf, rows, m.hidden,
                                   m.inter);
            // Tile t's column j goes to warp (t * columns + j) mod n_warps: every warp works
            // when a message has more tiles than a tile has columns for the warps.
            for (int r0 = 0; r0 < (gemm ? 0 : rows); r0 += FFN_MAX_ROWS) {
                const int n = min(FFN_MAX_ROWS, rows - r0);
                const int first = serve_tile_first(warp, n_warps, r0 / FFN_MAX_ROWS, m.inter);
                if (fast)
                    dpu_ffn_gate_up_rows(inbuf + (size_t)r0 * hidden8,
                                         (const uint4*)(blob + m.gate),
                                         (const uint4*)(blob + m.up),
                                         hbuf + (size_t)r0 * m.inter, n, hidden8, m.inter, first,
                                         n_warps);
                else
                    serve_gate_up_strided((const unsigned short*)inbuf + (size_t)r0 * m.hidden,
                                          blob, m, hbuf + (size_t)r0 * m.inter, n, first,
                                          n_warps);
            }
            serve_barrier(c);
            if (gemm)
                serve_down_gemm(hbuf, (const unsigned short*)(blob + m.down), outbuf, rows,
                                m.hidden, m.inter);
            for (int r0 = 0; r0 < (gemm ? 0 : rows); r0 += FFN_MAX_ROWS) {
                const int n = min(FFN_MAX_ROWS, rows - r0);
                const int first = serve_tile_first(warp, n_warps, r0 / FFN_MAX_ROWS, m.hidden);
                if (fast)
                    dpu_ffn_down_rows((const float4*)(hbuf + (size_t)r0 * m.inter),
                                      (const uint4*)(blob + m.down),
                                      outbuf + (size_t)r0 * m.hidden, n, inter8, m.hidden, first,
                                      n_warps);
                else
                    serve_down_strided(hbuf + (size_t)r0 * m.inter, blob, m,
                                       outbuf + (size_t)r0 * m.hidden, n, first, n_warps);
            }
            serve_barrier(c);
            const unsigned long long sent = serve_send(tx_hdr, tx, (const unsigned char*)outbuf,
                                                       c->total, c, 0u, 0u, scratch);
            serve_barrier(c);
            if (leader) {
                c->tx_pos += sent;
                c->served += 1;
            }
        } else if (action == SERVE_ERROR) {
            if (blockIdx.x == 0) {  // one packet: the reason, 64 bytes NUL-padded
                for (int i = threadIdx.x; i < 64; i += blockDim.x)
                    reason[i] = (unsigned char)SERVE_REASONS[c->reason][i];
                __syncthreads();
                const unsigned long long sent = serve_send(tx_hdr, tx, reason, 64, c,
                                                           DPU_PACKET_ERROR, c->status, scratch);
                if (threadIdx.x == 0) {
                    c->tx_pos += sent;
                    c->failed += 1;
                }
            }
        }
        serve_barrier(c);
    }
}
