// Send kernel: packetize a device buffer into tx ring entries (header + payload), the
// GPUNetIO txq-shaped producer. Twin: reference.send_packets.
//
// The buffer is the part of a message of `message_bytes` bytes that starts `base` bytes in.
// Packet p goes to ring position first_pos + p (dpu_put_packet, packets.cuh), its offset
// counted within the message, LAST on the part's last packet.
#include "packets.cuh"

extern "C" __global__ void dpu_send(dpu_ring_header* tx_hdr, unsigned char* tx_entries,
                                    const uint4* __restrict__ src, unsigned long long nbytes,
                                    unsigned long long first_pos, unsigned long long message_id,
                                    unsigned int model, unsigned int layer, unsigned int expert,
                                    unsigned long long base, unsigned long long message_bytes) {
    __shared__ uint32_t scratch[32];
    const unsigned long long room = tx_hdr->entry_size - sizeof(dpu_packet_header);
    const unsigned long long packets = (nbytes + room - 1) / room;
    for (unsigned long long p = blockIdx.x; p < packets; p += gridDim.x) {
        const unsigned long long offset = p * room;
        const unsigned long long len = min(room, nbytes - offset);
        const dpu_packet_fields f = {message_id, message_bytes,
                                     (offset + len == nbytes) ? DPU_PACKET_LAST : 0u, 0u, model,
                                     layer, expert};
        dpu_put_packet(tx_hdr, tx_entries, first_pos + p, src + offset / 16, base + offset, len,
                       f, scratch);
    }
}
