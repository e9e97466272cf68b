// The rates of the simulator's running activities (internal/sim.h, the model: simulator.h).
#include <algorithm>
#include <limits>
#include <vector>

#include "ditscale/sp/internal/fair_share.h"
#include "ditscale/sp/internal/sim.h"

namespace ditscale::sp::internal {

// Resources: GPU egress, GPU ingress, NIC egress, NIC ingress, then (duplex) NIC both ways.
std::vector<double> Sim::Capacities(int m, bool duplex) const {
  std::vector<double> cap(2 * n_ + (duplex ? 3 : 2) * m);
  for (int r = 0; r < n_; ++r) cap[r] = cap[n_ + r] = t_.intra_bandwidth_Bps;
  for (int i = 0; i < m; ++i) cap[2 * n_ + i] = cap[2 * n_ + m + i] = t_.nic_bandwidth_Bps;
  if (duplex) {
    for (int i = 0; i < m; ++i) cap[2 * n_ + 2 * m + i] = t_.nic_duplex_Bps;
  }
  return cap;
}

// attention_holds_sms: an attention call holds every SM until it ends, so a transfer launched
// as a kernel (NCCL's; NVSHMEM's between machines) that became ready after an attention op
// started on either end waits for it; one that was running when the attention op started keeps
// its SMs and runs beside it. Per rank: when its running attention op started (+inf: none).
std::vector<double> Sim::AttentionSince() const {
  const double kNever = std::numeric_limits<double>::infinity();
  std::vector<double> attention_since(n_, kNever);
  if (t_.attention_holds_sms) {
    for (const Activity& a : acts_) {
      if (a.phase == Phase::kWork && a.compute_stream &&
          ops_[a.gid].op->kind == OpKind::kAttention) {
        attention_since[a.src] = std::min(attention_since[a.src], a.t0);
      }
    }
  }
  return attention_since;
}

// *stalled: the activities that wait for an attention call (never with an SM partition).
// *sm_taking: two-sided transfers running (not stalled) per rank: only NCCL's kernels run for
// the whole transfer and take SMs from compute.
void Sim::MarkStalls(const std::vector<double>& attention_since, std::vector<char>* stalled,
                     std::vector<int>* sm_taking) const {
  const bool partitioned = compute_sms_ > 0;
  auto late = [&](const Activity& a, int rank) { return attention_since[rank] < a.t0; };
  stalled->assign(acts_.size(), 0);
  sm_taking->assign(n_, 0);
  for (size_t i = 0; i < acts_.size(); ++i) {
    const Activity& a = acts_[i];
    if (a.comm_kernel) {
      (*stalled)[i] = !partitioned && late(a, a.src);
      continue;
    }
    if (!a.needs_sm) continue;
    (*stalled)[i] = !partitioned && a.phase != Phase::kWork && (late(a, a.src) || late(a, a.dst));
    if (!(*stalled)[i] && a.two_sided && !partitioned) {
      ++(*sm_taking)[a.src];
      if (a.dst != a.src) ++(*sm_taking)[a.dst];
    }
  }
}

// The resources a data phase crosses: its GPUs' links within a machine, else both NICs (and
// their duplex limits); with a partition, the free SMs of an end where it started late.
FlowResources Sim::FlowOf(const Activity& a, int m, bool duplex, int free_sms_base, bool late_src,
                          bool late_dst) const {
  FlowResources f = {-1, -1, -1, -1, -1, -1};
  if (t_.SameMachine(a.src, a.dst)) {
    f[0] = a.src;
    f[1] = n_ + a.dst;
  } else {
    const int from = t_.NicOf(a.src), to = t_.NicOf(a.dst);
    f[0] = 2 * n_ + from;
    f[1] = 2 * n_ + m + to;
    if (duplex) {
      f[2] = 2 * n_ + 2 * m + from;
      f[3] = 2 * n_ + 2 * m + to;
    }
  }
  if (compute_sms_ > 0 && a.needs_sm) {
    if (late_src) f[4] = free_sms_base + a.src;
    if (late_dst) f[5] = free_sms_base + a.dst;
  }
  return f;
}

void Sim::Recompute() {
  const int m = t_.machines * t_.Nics();  // NICs in the cluster
  const bool duplex = t_.nic_duplex_Bps > 0;
  std::vector<double> cap = Capacities(m, duplex);
  const std::vector<double> attention_since = AttentionSince();
  // With an SM partition nothing stalls: a kernel that would wait runs on the SMs outside the
  // partition instead, at their copy rate (resources 2n + (duplex ? 3 : 2)m + rank); one that
  // started before the call has its SMs, as without a partition.
  const bool partitioned = compute_sms_ > 0;
  const int free_sms_base = int(cap.size());
  if (partitioned) cap.resize(cap.size() + n_, free_sm_Bps_);
  auto late = [&](const Activity& a, int rank) { return attention_since[rank] < a.t0; };
  std::vector<char> stalled;
  std::vector<int> sm_taking;
  MarkStalls(attention_since, &stalled, &sm_taking);
  std::vector<FlowResources> flows;
  std::vector<int> idx;
  inter_flows_ = 0;
  for (int i = 0; i < int(acts_.size()); ++i) {
    Activity& a = acts_[i];
    if (stalled[i]) {
      a.rate = 0;
    } else if (a.phase == Phase::kData) {
      flows.push_back(FlowOf(a, m, duplex, free_sms_base, late(a, a.src), late(a, a.dst)));
      if (!t_.SameMachine(a.src, a.dst)) ++inter_flows_;
      idx.push_back(i);
    } else if (a.phase == Phase::kWork && a.compute_stream) {
      // Running NCCL kernels take SMs from concurrent compute (stalled ones take none).
      a.rate = sm_taking[a.src] > 0 ? 1.0 - t_.two_sided_sm_fraction : 1.0;
    } else if (a.phase == Phase::kWork && a.comm_kernel && partitioned && late(a, a.src)) {
      a.rate = std::min(1.0, free_sm_Bps_ / t_.hbm_bandwidth_Bps);
    } else {
      a.rate = 1.0;
    }
  }
  std::vector<double> rates = MaxMinFairRatesWide(cap, flows);
  for (size_t k = 0; k < idx.size(); ++k) {
    Activity& a = acts_[idx[k]];
    a.rate = rates[k];
    // An inter-machine transfer slows while either end computes (the share it loses is not
    // handed to other flows: the loss is at the ends, not on the link).
    if (t_.inter_compute_interference > 0 && !t_.SameMachine(a.src, a.dst) &&
        (compute_running_[a.src] > 0 || compute_running_[a.dst] > 0)) {
      a.rate *= 1.0 - t_.inter_compute_interference;
    }
  }
}

}  // namespace ditscale::sp::internal
