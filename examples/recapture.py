"""When an optimized module builds a graph, and what each build costs (docs/recapture.md): a
training loop that validates after every step, and batches of varying sequence length."""

import torch
import transformers

import autoopt

config = transformers.BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64)
model = transformers.BertForSequenceClassification(config)
ids = torch.randint(0, 128, (4, 16))
labels = torch.randint(0, 2, (4,))

fast = autoopt.optimize(model, (ids,), {"labels": labels}, training=True)
optimizer = torch.optim.AdamW(fast.parameters(), lr=1e-3)
for step in range(6):
    fast.train()
    length = (16, 9, 23)[step % 3]  # a second length makes that dimension dynamic
    batch = torch.randint(0, 128, (4, length))
    fast(batch, labels=labels).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    fast.eval()
    with torch.no_grad():  # validation: no gradient graph is built
        logits = fast(batch).logits

for i, capture in enumerate(fast.report.captures):
    print(i, capture.inputs, "rebuilt", capture.rebuilds, "time(s)")
