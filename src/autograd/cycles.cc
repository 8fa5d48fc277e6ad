#include "autograd/cycles.h"

#include <cstring>
#include <span>
#include <unordered_map>

#include "autograd/function.h"
#include "runtime/backend.h"

namespace tally::autograd {


namespace {

// A vertex of the reference graph: a node or a tensor.
struct Vertex {
  const Node* node = nullptr;
  const TensorImpl* tensor = nullptr;
  bool operator==(const Vertex& o) const { return node == o.node && tensor == o.tensor; }
};
struct VertexHash {
  size_t operator()(const Vertex& v) const {
    return std::hash<const void*>()(v.node ? static_cast<const void*>(v.node) : static_cast<const void*>(v.tensor));
  }
};
struct Link {
  Vertex to;
  const char* how;  // nullptr for the ordinary links (edges, grad_fn)
};
// An accumulator refers to its leaf weakly (R2): the walk follows that link to find what
// the leaf holds (its hooks), but a cycle through it owns nothing and is not reported.
const char* const kWeak = "weak";

class ReferenceGraph {
 public:
  ReferenceGraph() {
    // Every tensor alive now, by address: what a scanned word may point to.
    for (runtime::Backend* b : runtime::active_backends())
      for (const memory::LiveAllocation& a : b->ledger().live())
        if (auto storage = a.storage.lock())
          for (auto& view : storage->views()) live_[view.get()] = view;
  }

  std::vector<Link> links(const Vertex& v) const {
    std::vector<Link> out;
    if (v.node) {
      for (const Edge& e : v.node->next_edges())
        if (e.node) out.push_back({{e.node.get(), nullptr}, nullptr});
      if (auto* acc = dynamic_cast<const AccumulateGrad*>(v.node))
        if (auto leaf = acc->leaf()) {
          out.push_back({{nullptr, leaf.get()}, kWeak});
          keep_alive_.push_back(std::move(leaf));
        }
      scan(v.node->context_bytes(), "context member", out);
      for (const auto& h : v.node->pre_hooks()) hook_links(*h, out);
    } else {
      const auto& state = v.tensor->autograd();
      if (auto* in = std::get_if<InteriorState>(&state)) out.push_back({{in->grad_fn.get(), nullptr}, nullptr});
      if (auto* leaf = std::get_if<LeafState>(&state))
        for (const auto* list : {&leaf->hooks, &leaf->post_accumulate_hooks})
          for (const auto& h : *list) hook_links(*h, out);
    }
    return out;
  }

  static std::string name(const Vertex& v) {
    if (v.node) {
      std::string s = v.node->name();
      if (!v.node->module_path().empty()) s += " [" + v.node->module_path() + "]";
      return s;
    }
    return "tensor " + (v.tensor->name().empty() ? std::string(dtype_name(v.tensor->dtype())) + shape_str(v.tensor->shape())
                                                : "'" + v.tensor->name() + "'");
  }

 private:
  // A tensor held by value shows as its handle's two words; the first (the TensorImpl
  // address) finds the candidate, bytes_hold_tensor confirms the whole handle.
  // Containers among the bytes are followed one level (for_each_handle_span); one counts
  // only when every element is an undefined Tensor or a live one.
  void scan(std::span<const std::byte> object, const char* how, std::vector<Link>& out) const {
    for_each_handle_span(object, [&](std::span<const std::byte> bytes, bool container) {
      const size_t before = out.size();
      const size_t stride = container ? sizeof(Tensor) : alignof(void*);
      for (size_t i = 0; i + sizeof(Tensor) <= bytes.size(); i += stride) {
        const void* word;
        std::memcpy(&word, bytes.data() + i, sizeof word);
        auto it = live_.find(word);
        const bool live = it != live_.end() &&
                          bytes_hold_tensor(bytes.subspan(i, sizeof(Tensor)),
                                            Tensor(std::const_pointer_cast<TensorImpl>(it->second)));
        if (live) {
          out.push_back({{nullptr, it->second.get()}, how});
        } else if (container && word != nullptr) {
          out.resize(before);  // not a vector of live tensors
          return;
        }
      }
    });
  }

  // A hook's captures found in its bytes, and the tensor it is registered on when it holds
  // that one where no scan sees (found at registration: a std::function's heap storage).
  void hook_links(const HookEntry& h, std::vector<Link>& out) const {
    if (!h.hook) return;
    const size_t before = out.size();
    scan(h.hook->captured_bytes(), "hook capture", out);
    if (!h.captures_own_tensor) return;
    auto own = h.registered_on.lock();
    if (!own) return;
    for (size_t i = before; i < out.size(); ++i)
      if (out[i].to.tensor == own.get()) return;
    out.push_back({{nullptr, own.get()}, "hook capture"});
    keep_alive_.push_back(std::move(own));
  }

  // Keep every tensor the walk may look at alive while it runs.
  std::unordered_map<const void*, std::shared_ptr<const TensorImpl>> live_;
  mutable std::vector<std::shared_ptr<const TensorImpl>> keep_alive_;
};

// Iterative three-colour DFS from `starts`; a grey successor closes a cycle.
std::vector<std::string> cycles_from(const std::vector<Vertex>& starts, const Vertex* through = nullptr) {
  ReferenceGraph graph;
  enum Colour { White, Grey, Black };
  std::unordered_map<Vertex, Colour, VertexHash> colour;
  std::vector<std::string> cycles;
  struct Frame {
    Vertex v;
    const char* how;  // how this frame was reached from the one below
    std::vector<Link> succ;
    size_t next = 0;
  };
  for (const Vertex& start : starts) {
    if (colour[start] != White) continue;
    std::vector<Frame> stack;
    stack.push_back({start, nullptr, graph.links(start)});
    colour[start] = Grey;
    while (!stack.empty()) {
      Frame& f = stack.back();
      if (f.next == f.succ.size()) {
        colour[f.v] = Black;
        stack.pop_back();
        continue;
      }
      const Link link = f.succ[f.next++];
      const Colour c = colour[link.to];
      if (c == Grey) {
        std::string line;
        bool in_cycle = false, has_through = through == nullptr, weak = link.how == kWeak;
        for (size_t i = 0; i < stack.size(); ++i) {
          const Frame& g = stack[i];
          if (g.v == link.to) in_cycle = true;
          if (!in_cycle) continue;
          if (through && g.v == *through) has_through = true;
          if (!line.empty()) {
            weak = weak || g.how == kWeak;
            line += g.how ? std::string(" -> (") + g.how + ") " : " -> ";
          }
          line += ReferenceGraph::name(g.v);
        }
        line += link.how ? std::string(" -> (") + link.how + ") " : " -> ";
        line += ReferenceGraph::name(link.to);
        if (has_through && !weak) cycles.push_back(line);
      } else if (c == White) {
        colour[link.to] = Grey;
        stack.push_back({link.to, link.how, graph.links(link.to)});
      }
    }
  }
  return cycles;
}

}  // namespace

std::vector<std::string> find_cycles(const std::vector<Tensor>& roots) {
  std::vector<Vertex> starts;
  for (const Tensor& r : roots)
    if (r.defined()) starts.push_back({nullptr, r.impl()});
  return cycles_from(starts);
}

std::vector<std::string> find_cycles_through(const Node& node) {
  Vertex v{&node, nullptr};
  return cycles_from({v}, &v);
}

std::vector<std::string> find_cycles_from(const std::vector<const Node*>& nodes) {
  std::vector<Vertex> starts;
  for (const Node* n : nodes) starts.push_back({n, nullptr});
  return cycles_from(starts);
}

std::vector<std::string> find_cycles_through(const TensorImpl& tensor) {
  Vertex v{nullptr, &tensor};
  return cycles_from({v}, &v);
}

}  // namespace tally::autograd
