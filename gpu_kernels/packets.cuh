// Writing one packet into a tx packet ring, block-wide: shared by the send kernel (send.cu) and
// the resident receiver (serve.cu). Twin: packet_twin.send_packets.
#ifndef DPU_PACKETS_CUH
#define DPU_PACKETS_CUH
#include "ring.cuh"

typedef struct {
    unsigned long long message_id, total_length;
    unsigned int flags, status, model, layer, expert;
    unsigned long long slot;
} dpu_packet_fields;

// Ring position `pos` gets `len` bytes (a multiple of 16) of `from`, which lie `offset` bytes
// into their message: thread 0 waits until the entry is free (position - consumer < capacity,
// or the ring's exit flag), the block writes the payload with 16-byte stores and reduces its
// checksum, then thread 0 writes the header, fences system-wide and publishes seq last.
__device__ void dpu_put_packet(dpu_ring_header* tx_hdr, unsigned char* tx_entries,
                               unsigned long long pos, const uint4* __restrict__ from,
                               unsigned long long offset, unsigned long long len,
                               const dpu_packet_fields f, uint32_t* scratch) {
    const unsigned long long size = tx_hdr->entry_size, cap = tx_hdr->capacity;
    if (threadIdx.x == 0) {
        while (pos - dpu_load_volatile_u64(&tx_hdr->consumer) >= cap) {
            if (dpu_load_volatile_u32(&tx_hdr->exit_flag)) break;
            __nanosleep(256);
        }
    }
    __syncthreads();
    unsigned char* entry = tx_entries + (pos & (cap - 1)) * size;
    uint4* payload = (uint4*)(entry + sizeof(dpu_packet_header));
    uint32_t sum = 0;
    for (unsigned long long i = threadIdx.x; i < len / 16; i += blockDim.x) {
        const uint4 v = from[i];
        payload[i] = v;
        sum += dpu_vec_terms(v, offset / 4 + 4 * i);
    }
    const uint32_t total = dpu_block_sum(sum, scratch);
    if (threadIdx.x == 0) {
        volatile dpu_packet_header* h = (volatile dpu_packet_header*)entry;
        h->message_id = f.message_id;
        h->offset = offset;
        h->length = (uint32_t)len;
        h->flags = f.flags;
        h->checksum = dpu_checksum_finish(total, len);
        h->layer = (uint16_t)f.layer;
        h->expert = (uint16_t)f.expert;
        h->model = f.model;
        h->status = f.status;
        h->total_length = f.total_length;
        h->slot = f.slot;
        __threadfence_system();
        h->seq = pos + 1;
    }
    __syncthreads();
}

#endif  // DPU_PACKETS_CUH
