// Send kernel: packetize a device buffer into tx ring entries (header + payload), the
// GPUNetIO txq-shaped producer. Twin: reference.send_packets.
//
// The buffer is the part of a message of `message_bytes` bytes that starts `base` bytes in.
// Packet p goes to ring position first_pos + p. A block waits until that entry is free (position -
// consumer < capacity), writes the payload with 16-byte stores, reduces its checksum, writes
// the header (offset within the message; LAST on the part's last packet), fences system-wide
// and publishes seq last.
#include "ring.cuh"

extern "C" __global__ void dpu_send(dpu_ring_header* tx_hdr, unsigned char* tx_entries,
                                    const uint4* __restrict__ src, unsigned long long nbytes,
                                    unsigned long long first_pos, unsigned long long message_id,
                                    unsigned int model, unsigned int layer, unsigned int expert,
                                    unsigned long long base, unsigned long long message_bytes) {
    __shared__ uint32_t scratch[32];
    const unsigned long long entry_size = tx_hdr->entry_size;
    const unsigned long long cap = tx_hdr->capacity;
    const unsigned long long payload_max = entry_size - sizeof(dpu_packet_header);
    const unsigned long long packets = (nbytes + payload_max - 1) / payload_max;
    for (unsigned long long p = blockIdx.x; p < packets; p += gridDim.x) {
        const unsigned long long pos = first_pos + p;
        if (threadIdx.x == 0) {
            while (pos - dpu_load_volatile_u64(&tx_hdr->consumer) >= cap) {
                if (dpu_load_volatile_u32(&tx_hdr->exit_flag)) break;
                __nanosleep(256);
            }
        }
        __syncthreads();
        unsigned char* entry = tx_entries + (pos & (cap - 1)) * entry_size;
        const unsigned long long offset = p * payload_max;
        const unsigned long long len = min(payload_max, nbytes - offset);
        uint4* payload = (uint4*)(entry + sizeof(dpu_packet_header));
        const uint4* from = src + offset / 16;
        uint32_t sum = 0;
        for (unsigned long long i = threadIdx.x; i < len / 16; i += blockDim.x) {
            const uint4 v = from[i];
            payload[i] = v;
            sum += dpu_vec_terms(v, (base + offset) / 4 + 4 * i);
        }
        const uint32_t total = dpu_block_sum(sum, scratch);
        if (threadIdx.x == 0) {
            volatile dpu_packet_header* h = (volatile dpu_packet_header*)entry;
            h->message_id = message_id;
            h->offset = base + offset;
            h->length = (uint32_t)len;
            h->flags = (offset + len == nbytes) ? DPU_PACKET_LAST : 0u;
            h->checksum = dpu_checksum_finish(total, len);
            h->layer = (uint16_t)layer;
            h->expert = (uint16_t)expert;
            h->model = model;
            h->status = 0u;
            h->total_length = message_bytes;
            h->slot = 0ull;
            __threadfence_system();
            h->seq = pos + 1;
        }
        __syncthreads();
    }
}
