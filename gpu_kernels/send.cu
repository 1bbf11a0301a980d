// Send kernel: packetize a device buffer into tx ring entries (header + payload), the
// GPUNetIO txq-shaped producer. Twin: packet_twin.send_packets.
//
// The buffer is the part of a message of `message_bytes` bytes that starts `base` bytes in.
// Packet p goes to ring position first_pos + p (dpu_put_packet, packets.cuh), its offset
// counted within the message; the part's last packet (the only one of an empty part) is
// flagged LAST | `flags`. Every header carries `slot` and `status`.
#include "packets.cuh"

extern "C" __global__ void dpu_send(dpu_ring_header* tx_hdr, unsigned char* tx_entries,
                                    const uint4* __restrict__ src, unsigned long long nbytes,
                                    unsigned long long first_pos, unsigned long long message_id,
                                    unsigned int model, unsigned int layer, unsigned int expert,
                                    unsigned long long base, unsigned long long message_bytes,
                                    unsigned long long slot, unsigned int status,
                                    unsigned int flags) {
    __shared__ uint32_t scratch[32];
    const unsigned long long room = tx_hdr->entry_size - sizeof(dpu_packet_header);
    const unsigned long long packets = nbytes ? (nbytes + room - 1) / room : 1;
    for (unsigned long long p = blockIdx.x; p < packets; p += gridDim.x) {
        const unsigned long long offset = p * room;
        const unsigned long long len = nbytes ? min(room, nbytes - offset) : 0;
        const dpu_packet_fields f = {message_id, message_bytes,
                                     p + 1 == packets ? DPU_PACKET_LAST | flags : 0u, status,
                                     model, layer, expert, slot};
        dpu_put_packet(tx_hdr, tx_entries, first_pos + p, src + offset / 16, base + offset, len,
                       f, scratch);
    }
}
