// Runs the real kernel source (w4a16_moe.cu compiled for the host with QMOE_EMU) under the
// emulator of emu.h on small random problems, both paths, and compares with a float64 reference
// computed straight from the slab bytes. Catches indexing, fragment-layout, tiling, padding and
// combine mistakes without a GPU; says nothing about races or speed.
//
// Build and run: scripts/kernel-emu.sh (g++ >= 11 and the CUDA headers of scripts/cuda-env.sh).

#define QMOE_EMU 1
#include "../cuda/w4a16_moe.cu"

#include <cstdio>
#include <random>
#include <string>

namespace {

struct Geo {
    int H, I, E, k, group;
    size_t gu_row, dn_row, off_dn_w, off_gu_s, off_dn_s, slab;
    int gu_groups, dn_groups;
};

size_t rup(size_t x, size_t m) { return (x + m - 1) / m * m; }

Geo geometry(int H, int I, int E, int k, int group) {
    Geo g{H, I, E, k, group};
    g.gu_row = rup(H, 32) / 2;
    g.dn_row = rup(I, 32) / 2;
    g.gu_groups = (H + group - 1) / group;
    g.dn_groups = (I + group - 1) / group;
    const size_t gu_w = 2 * static_cast<size_t>(I) * g.gu_row, dn_w = static_cast<size_t>(H) * g.dn_row;
    g.off_dn_w = rup(gu_w, 16);
    g.off_gu_s = rup(g.off_dn_w + dn_w, 16);
    g.off_dn_s = rup(g.off_gu_s + 2 * 2 * static_cast<size_t>(I) * g.gu_groups, 16);
    g.slab = rup(g.off_dn_s + 2 * static_cast<size_t>(H) * g.dn_groups, 16);
    return g;
}

// Weight (row, col) of a packed matrix: scale · (nibble − 8), nibble order [e0,e2,e4,e6,e1,e3,e5,e7].
double weight(const uint8_t* w, const uint16_t* s, size_t row_bytes, int groups, int group, int row, int col) {
    const int chunk = col / 32, j = col % 32, word = j / 8, e = j % 8;
    const int p = (e % 2) * 4 + e / 2;
    const uint8_t byte = w[row * row_bytes + chunk * 16 + word * 4 + p / 2];
    const int nib = (p % 2) ? (byte >> 4) : (byte & 15);
    return static_cast<double>(emu::to_f<false>(s[static_cast<size_t>(row) * groups + col / group])) * (nib - 8);
}

template <class T> struct Name;
template <> struct Name<__nv_bfloat16> { static constexpr const char* s = "bf16"; static constexpr bool bf = true; };
template <> struct Name<__half> { static constexpr const char* s = "f16"; static constexpr bool bf = false; };
template <> struct Name<float> { static constexpr const char* s = "f32"; static constexpr bool bf = true; };

template <class T> float round_to(float v) {
    if constexpr (sizeof(T) == 4) {
        return v;
    } else {
        return emu::to_f<Name<T>::bf>(emu::from_f<Name<T>::bf>(v));
    }
}
template <class T> float load(const T* p, size_t i) {
    if constexpr (sizeof(T) == 4) {
        return p[i];
    } else {
        uint16_t b;
        std::memcpy(&b, p + i, 2);
        return emu::to_f<Name<T>::bf>(b);
    }
}

using Kernel = void (*)(const void*);
template <void (*K)(const MoeParams)> void thunk(const void* p) { K(*static_cast<const MoeParams*>(p)); }

template <class T> struct Kernels;
#define QMOE_KSET(T, SUF)                                                                           \
    template <> struct Kernels<T> {                                                                 \
        static constexpr Kernel gu1 = thunk<qmoe_decode_gate_up_##SUF##_nt1>;                       \
        static constexpr Kernel gu2 = thunk<qmoe_decode_gate_up_##SUF##_nt2>;                       \
        static constexpr Kernel dn1 = thunk<qmoe_decode_down_##SUF##_nt1>;                          \
        static constexpr Kernel dn2 = thunk<qmoe_decode_down_##SUF##_nt2>;                          \
        static constexpr Kernel pgu = thunk<qmoe_prefill_gate_up_##SUF>;                            \
        static constexpr Kernel pdn = thunk<qmoe_prefill_down_##SUF>;                               \
        static constexpr Kernel comb = thunk<qmoe_combine_##SUF>;                                   \
    };
QMOE_KSET(__nv_bfloat16, bf16)
QMOE_KSET(__half, f16)
QMOE_KSET(float, f32)

// Dynamic shared memory as the Rust launcher sizes it (moe_geometry.h).
size_t decode_smem(const Geo& g, int K, int T, int es) {
    return QMOE_DEC_SMEM(K, std::min(T, QMOE_DEC_MAX_TOKENS), es, g.group);
}
size_t prefill_smem(const Geo& g, int K, int es) { return QMOE_PRE_SMEM(K, es, g.group); }

// How the routed ids of a case are drawn: k distinct experts per token (what top-k gives), each
// token's last id repeating its first, about a third of the ids out of range (pairs a residency
// manager computes elsewhere), or every id out of range.
enum class Routing { Distinct, Repeats, SomeOutOfRange, NoneInRange };
const char* routing_name(Routing r) {
    switch (r) {
        case Routing::Distinct: return "";
        case Routing::Repeats: return " repeats";
        case Routing::SomeOutOfRange: return " some-out-of-range";
        case Routing::NoneInRange: return " none-in-range";
    }
    return "";
}

template <class T>
bool run_case(int H, int I, int E, int k, int group, int T_, bool decode, uint64_t seed,
              Routing routing = Routing::Distinct) {
    const Geo g = geometry(H, I, E, k, group);
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int> byte(0, 255);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    // Slabs in reversed slot order, so the expert -> slot table matters.
    std::vector<uint8_t> slabs(g.slab * E);
    for (auto& b : slabs) b = static_cast<uint8_t>(byte(rng));
    for (int e = 0; e < E; ++e) {
        uint8_t* s = slabs.data() + g.slab * e;
        auto fill = [&](size_t off, size_t n) {
            for (size_t i = 0; i < n; ++i) {
                const uint16_t v = emu::from_f<false>(0.002f + 0.002f * (uni(rng) + 1.f));
                std::memcpy(s + off + 2 * i, &v, 2);
            }
        };
        fill(g.off_gu_s, 2 * static_cast<size_t>(I) * g.gu_groups);
        fill(g.off_dn_s, static_cast<size_t>(H) * g.dn_groups);
    }
    std::vector<uint32_t> slot(E);
    for (int e = 0; e < E; ++e) slot[e] = E - 1 - e;
    std::vector<float> xf(static_cast<size_t>(T_) * H);
    for (auto& v : xf) v = round_to<T>(uni(rng) * 2.f);
    std::vector<T> x(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) {
        if constexpr (sizeof(T) == 4) {
            x[i] = xf[i];
        } else {
            const uint16_t b = emu::from_f<Name<T>::bf>(xf[i]);
            std::memcpy(&x[i], &b, 2);
        }
    }
    std::vector<uint32_t> ids(static_cast<size_t>(T_) * k);
    std::vector<float> rw(ids.size());
    for (int t = 0; t < T_; ++t) {
        std::vector<int> perm(E);
        for (int e = 0; e < E; ++e) perm[e] = e;
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int j = 0; j < k; ++j) {
            ids[t * k + j] = perm[j];
            rw[t * k + j] = 0.1f + 0.9f * (uni(rng) + 1.f) / 2.f;
            if (routing == Routing::Repeats && j == k - 1 && k > 1) ids[t * k + j] = perm[0];
            if (routing == Routing::NoneInRange || (routing == Routing::SomeOutOfRange && byte(rng) < 85))
                ids[t * k + j] = E + static_cast<uint32_t>(byte(rng) % 3);
        }
    }
    // Reference (float64 from the bytes; slab of expert e at slot[e]).
    std::vector<double> want(static_cast<size_t>(T_) * H, 0.0);
    for (int t = 0; t < T_; ++t)
        for (int j = 0; j < k; ++j) {
            const int e = ids[t * k + j];
            if (e >= E) continue;
            const uint8_t* s = slabs.data() + g.slab * slot[e];
            const auto* gus = reinterpret_cast<const uint16_t*>(s + g.off_gu_s);
            const auto* dns = reinterpret_cast<const uint16_t*>(s + g.off_dn_s);
            std::vector<double> h(I);
            for (int i = 0; i < I; ++i) {
                double gate = 0, up = 0;
                for (int c = 0; c < H; ++c) {
                    gate += weight(s, gus, g.gu_row, g.gu_groups, group, i, c) * xf[t * H + c];
                    up += weight(s, gus, g.gu_row, g.gu_groups, group, I + i, c) * xf[t * H + c];
                }
                h[i] = gate / (1.0 + std::exp(-gate)) * up;
            }
            for (int n = 0; n < H; ++n) {
                double y = 0;
                for (int i = 0; i < I; ++i) y += weight(s + g.off_dn_w, dns, g.dn_row, g.dn_groups, group, n, i) * h[i];
                want[t * H + n] += rw[t * k + j] * y;
            }
        }

    const int P = T_ * k;
    std::vector<T> out(static_cast<size_t>(T_) * H), hbuf(static_cast<size_t>(P) * I);
    std::vector<float> y(static_cast<size_t>(P) * H);
    std::memset(out.data(), 0xff, out.size() * sizeof(T));
    std::memset(hbuf.data(), 0xff, hbuf.size() * sizeof(T));
    std::memset(y.data(), 0xff, y.size() * sizeof(float));
    const int max_tiles = (P + QMOE_PRE_PAIRS - 1) / QMOE_PRE_PAIRS + std::min(E, P);
    std::vector<uint32_t> counters((H + QMOE_DEC_ROWS - 1) / QMOE_DEC_ROWS, 0), rank(P), sorted(P, 0xffffffffu), tiles(3 * max_tiles, 0xffffffffu),
        ntiles(1, 0xffffffffu);
    MoeParams p{};
    p.slabs = slabs.data();
    p.slot_of = slot.data();
    p.x = x.data();
    p.ids = ids.data();
    p.route_w = rw.data();
    p.h = hbuf.data();
    p.y = y.data();
    p.out = out.data();
    p.counters = counters.data();
    p.rank = rank.data();
    p.sorted = sorted.data();
    p.tiles = tiles.data();
    p.num_tiles = ntiles.data();
    p.slab_bytes = g.slab;
    p.off_gu_w = 0;
    p.off_dn_w = g.off_dn_w;
    p.off_gu_s = g.off_gu_s;
    p.off_dn_s = g.off_dn_s;
    p.tokens = T_;
    p.top_k = k;
    p.num_experts = E;
    p.hidden = H;
    p.inter = I;
    p.group = group;
    p.max_tiles = max_tiles;
    const int es = sizeof(T);
    using K = Kernels<T>;
    const auto blocks = [](int n, int per) { return static_cast<unsigned>((n + per - 1) / per); };
    if (decode) {
        const bool two = T_ > 8;
        const unsigned by = std::min(E, P);
        emu::launch(two ? K::gu2 : K::gu1, &p, {blocks(I, QMOE_DEC_GATE_UP_ROWS), by, 1}, QMOE_NTHREADS,
                    decode_smem(g, H, T_, es));
        emu::launch(two ? K::dn2 : K::dn1, &p, {blocks(H, QMOE_DEC_ROWS), by, 1}, QMOE_NTHREADS,
                    decode_smem(g, I, T_, es));
    } else {
        emu::launch(thunk<qmoe_route>, &p, {1, 1, 1}, QMOE_ROUTE_THREADS, 0);
        emu::launch(K::pgu, &p, {blocks(I, QMOE_PRE_GATE_UP_ROWS), static_cast<unsigned>(max_tiles), 1}, QMOE_NTHREADS,
                    prefill_smem(g, H, es));
        emu::launch(K::pdn, &p, {blocks(H, QMOE_PRE_ROWS), static_cast<unsigned>(max_tiles), 1}, QMOE_NTHREADS,
                    prefill_smem(g, I, es));
        emu::launch(K::comb, &p, {blocks(H, QMOE_COMBINE_COLS), static_cast<unsigned>(T_), 1}, QMOE_NTHREADS, 0);
    }
    double num = 0, den = 0;
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) {
        const float v = load(out.data(), i);
        if (!std::isfinite(v)) ++bad;
        num += (v - want[i]) * (v - want[i]);
        den += want[i] * want[i];
    }
    bool counters_clear = true;
    for (auto c : counters) counters_clear &= c == 0;
    const double err = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    const double tol = sizeof(T) == 4 ? 1e-4 : (Name<T>::bf ? 1e-2 : 2e-3);
    const bool ok = bad == 0 && err <= tol && counters_clear;
    std::printf("%s %-7s %-4s H%d I%d E%d k%d g%d T%d%s: %s err %.2e, non-finite %zu%s\n", ok ? "PASS" : "FAIL",
                decode ? "decode" : "prefill", Name<T>::s, H, I, E, k, group, T_, routing_name(routing),
                den > 0 ? "rel" : "abs", err, bad, counters_clear ? "" : ", counters not reset");
    return ok;
}

}  // namespace

int main(int argc, char** argv) {
    const std::string mode = argc > 1 ? argv[1] : "";
    const bool quick = mode == "--quick";
    int failed = 0, total = 0;
    auto check = [&](bool ok) {
        ++total;
        failed += ok ? 0 : 1;
    };
    uint64_t seed = 1;
    if (mode == "--race") {
        // Few, small cases that still reach every kernel and code path (both decode tiles, the
        // pipelines wrapping around their stages, several prefill tiles per expert, the decode
        // combine by the last block), for the slow sanitizer builds of scripts/kernel-emu.sh.
        check(run_case<__nv_bfloat16>(2304, 64, 4, 2, 128, 3, true, seed++));
        check(run_case<__half>(264, 200, 4, 2, 64, 12, true, seed++));
        check(run_case<float>(264, 72, 8, 2, 32, 2, true, seed++));
        check(run_case<__nv_bfloat16>(2304, 64, 4, 2, 128, 20, false, seed++));
        check(run_case<float>(264, 72, 2, 1, 64, 70, false, seed++));
        check(run_case<__nv_bfloat16>(264, 72, 5, 4, 64, 5, true, seed++, Routing::Repeats));
        check(run_case<__nv_bfloat16>(264, 72, 8, 4, 64, 5, true, seed++, Routing::NoneInRange));
        std::printf("emulated kernels: %d cases, %d failed\n", total, failed);
        return failed == 0 ? 0 : 1;
    }
    // K not a multiple of 32 (padded chunks) and of the group (partial last group).
    for (int group : {32, 64}) {
        for (int T_ : {1, 3, 9}) {
            check(run_case<__nv_bfloat16>(264, 200, 8, 2, group, T_, true, seed++));
            if (!quick) {
                check(run_case<__half>(264, 200, 8, 2, group, T_, true, seed++));
                check(run_case<float>(264, 200, 8, 2, group, T_, true, seed++));
            }
        }
        for (int T_ : {3, 70}) {
            check(run_case<__nv_bfloat16>(264, 200, 8, 2, group, T_, false, seed++));
            if (!quick) {
                check(run_case<__half>(264, 200, 8, 2, group, T_, false, seed++));
                check(run_case<float>(264, 200, 8, 2, group, T_, false, seed++));
            }
        }
    }
    // More than 8 tokens on one expert (both decode tiles), more than 64 on one (several
    // prefill tiles), and K long enough that the pipelines wrap around their stages.
    check(run_case<__nv_bfloat16>(264, 200, 4, 2, 64, 16, true, seed++));
    check(run_case<__nv_bfloat16>(264, 200, 2, 1, 64, 150, false, seed++));
    check(run_case<__nv_bfloat16>(2304, 64, 4, 2, 128, 2, true, seed++));
    check(run_case<__nv_bfloat16>(2304, 64, 4, 2, 128, 20, false, seed++));
    // Many distinct experts, two 8-token tiles, k = 8.
    check(run_case<__nv_bfloat16>(256, 128, 40, 8, 128, 16, true, seed++));
    if (!quick) check(run_case<__nv_bfloat16>(256, 128, 40, 8, 128, 16, false, seed++));
    // Ids the kernels must survive: repeats within a token (5 experts for k = 4, so that some
    // expert gets more pairs than there are tokens), ids out of range, none in range.
    for (Routing r : {Routing::Repeats, Routing::SomeOutOfRange, Routing::NoneInRange})
        for (bool dec : {true, false}) {
            const int E = r == Routing::Repeats ? 5 : 8;
            check(run_case<__nv_bfloat16>(264, 200, E, 4, 64, 5, dec, seed++, r));
            if (!quick) check(run_case<float>(264, 200, E, 4, 64, 12, dec, seed++, r));
        }
    std::printf("emulated kernels: %d cases, %d failed\n", total, failed);
    return failed == 0 ? 0 : 1;
}
