// Deferred validation's flag words (validation.py). Each owner has two words: the flag word kernels raise bits
// in, then its carry word, where a closed generation's flags wait for the recipients that read them later.

// The prologue of a generation: the flags of the generation before move to the carry word and the flag word is
// cleared. One launch, so a device graph that records it replays a generation's start with the rest of the step.
extern "C" __global__ void carry_and_clear(unsigned int* words) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        words[1] = words[0];
        words[0] = 0u;
    }
}

// After a replayed graph whose recorded prologue ran once more in a generation already begun: the flags raised
// before the launch, which that prologue moved to the carry word, go back into the flag word.
extern "C" __global__ void merge_carry(unsigned int* words) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        words[0] |= words[1];
    }
}
