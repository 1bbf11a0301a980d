// Packet receive kernel: land one message's packets from an rx packet ring into a device
// buffer, the GPUNetIO rxq-shaped consumer of the activation path. Twin:
// packet_twin.receive_packets.
//
// Block b takes packets b, b + gridDim.x, ... of the message starting at ring position
// first_pos. It waits for the entry's seq word, reads the header, and refuses the packet
// unless its payload is 16-byte aligned, fits the entry and lands inside dst (checked so no
// addition wraps). It then sums the payload's checksum terms, keeping up to 4 vectors per
// thread in registers, and writes the payload only when the checksum matches: a refused
// packet never writes a byte. Counters (out): [0] bytes written, [1] packets refused,
// [2] message id of the LAST packet. The host advances the ring's consumer after the launch.
#include "ring.cuh"

extern "C" __global__ void dpu_receive_packets(const dpu_ring_header* rx_hdr,
                                               const unsigned char* rx_entries,
                                               uint4* __restrict__ dst, unsigned long long dst_bytes,
                                               unsigned long long first_pos,
                                               unsigned long long packets,
                                               unsigned long long* out) {
    __shared__ unsigned long long offset, length, message_id;
    __shared__ uint32_t checksum, flags;
    __shared__ unsigned int sane, good, stop;
    __shared__ uint32_t scratch[32];
    const unsigned long long entry_size = rx_hdr->entry_size;
    const unsigned long long cap = rx_hdr->capacity;
    const unsigned long long room = entry_size - sizeof(dpu_packet_header);
    for (unsigned long long p = blockIdx.x; p < packets; p += gridDim.x) {
        const unsigned long long pos = first_pos + p;
        const unsigned char* entry = rx_entries + (pos & (cap - 1)) * entry_size;
        if (threadIdx.x == 0) {
            const volatile dpu_packet_header* h = (const volatile dpu_packet_header*)entry;
            stop = 0;
            while (h->seq != pos + 1) {
                if (dpu_load_volatile_u32(&rx_hdr->exit_flag)) { stop = 1; break; }
                __nanosleep(128);
            }
            __threadfence_system();
            offset = h->offset;
            length = h->length;
            checksum = h->checksum;
            flags = h->flags;
            message_id = h->message_id;
            sane = length <= room && length % 16 == 0 && offset % 16 == 0 &&
                   offset <= dst_bytes && length <= dst_bytes - offset;
        }
        __syncthreads();
        if (stop) return;
        const uint4* src = (const uint4*)(entry + sizeof(dpu_packet_header));
        const unsigned long long n16 = sane ? length / 16 : 0;
        const unsigned long long first_word = offset / 4;
        uint4 v[4];
        uint32_t sum = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned long long i = threadIdx.x + (unsigned long long)k * blockDim.x;
            if (i < n16) {
                v[k] = src[i];
                sum += dpu_vec_terms(v[k], first_word + 4 * i);
            }
        }
        for (unsigned long long i = threadIdx.x + 4ull * blockDim.x; i < n16; i += blockDim.x)
            sum += dpu_vec_terms(src[i], first_word + 4 * i);
        const uint32_t total = dpu_block_sum(sum, scratch);
        if (threadIdx.x == 0) {
            good = sane && dpu_checksum_finish(total, length) == checksum;
            if (good) atomicAdd(&out[0], length);
            else atomicAdd(&out[1], 1ull);
            if (flags & DPU_PACKET_LAST) out[2] = message_id;
        }
        __syncthreads();
        if (good) {
            uint4* to = dst + offset / 16;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const unsigned long long i = threadIdx.x + (unsigned long long)k * blockDim.x;
                if (i < n16) to[i] = v[k];
            }
            for (unsigned long long i = threadIdx.x + 4ull * blockDim.x; i < n16; i += blockDim.x)
                to[i] = src[i];
        }
        __syncthreads();
    }
}
