"""A single-process word language model in the shape of pytorch/examples word_language_model/main.py
(a stateful LSTM carried across batches, batchify/get_batch, clipping, manual SGD with the learning rate
divided by 4 when the validation loss stops improving), on a corpus of words from three modules of the
Python standard library: nothing to download.

    dptrain launch --nproc-per-node 2 examples/ports/word_lm_dptrain.py   # 2 processes, or
    python examples/ports/word_lm_dptrain.py                                # a world of one

Ported from word_lm_base.py with dptrain (docs/guides/porting.md): each rank carries its columns.
"""

import argparse
import json
import math
import os
import sysconfig
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import dptrain

parser = argparse.ArgumentParser(description='LSTM word language model on Python standard library text')
parser.add_argument('--emsize', type=int, default=32, help='size of word embeddings')
parser.add_argument('--nhid', type=int, default=32, help='number of hidden units per layer')
parser.add_argument('--nlayers', type=int, default=2, help='number of layers')
parser.add_argument('--lr', type=float, default=20, help='initial learning rate')
parser.add_argument('--clip', type=float, default=0.25, help='gradient clipping')
parser.add_argument('--epochs', type=int, default=3, help='upper epoch limit')
parser.add_argument('--batch_size', type=int, default=20, metavar='N', help='batch size')
parser.add_argument('--bptt', type=int, default=20, help='sequence length')
parser.add_argument('--dropout', type=float, default=0.2, help='dropout applied to layers (0 = no dropout)')
parser.add_argument('--seed', type=int, default=1111, help='random seed')
parser.add_argument('--log-interval', type=int, default=2, metavar='N', help='report interval')
parser.add_argument('--save', type=str, default='model.pt', help='path to save the final model')
parser.add_argument('--losses', help='write the per-step losses and validation losses to this JSON file')
args = parser.parse_args()

runtime = dptrain.init_distributed()
torch.manual_seed(args.seed)
device = runtime.device

###############################################################################
# Load data: words of three standard-library modules, one <eos> per line
###############################################################################


class Dictionary:
    def __init__(self):
        self.word2idx = {}
        self.idx2word = []

    def add_word(self, word):
        if word not in self.word2idx:
            self.idx2word.append(word)
            self.word2idx[word] = len(self.idx2word) - 1
        return self.word2idx[word]

    def __len__(self):
        return len(self.idx2word)


class Corpus:
    def __init__(self, path):
        self.dictionary = Dictionary()
        self.train = self.tokenize(os.path.join(path, 'textwrap.py'))
        self.valid = self.tokenize(os.path.join(path, 'shlex.py'))
        self.test = self.tokenize(os.path.join(path, 'colorsys.py'))

    def tokenize(self, path):
        ids = []
        with open(path, encoding='utf8') as f:
            for line in f:
                ids.extend(self.dictionary.add_word(word) for word in line.split() + ['<eos>'])
        return torch.tensor(ids, dtype=torch.int64)


corpus = Corpus(sysconfig.get_paths()['stdlib'])


def batchify(data, bsz):
    # Work out how cleanly we can divide the dataset into bsz parts, trim off the remainder,
    # and make each of the bsz streams a column.
    nbatch = data.size(0) // bsz
    data = data.narrow(0, 0, nbatch * bsz)
    data = data.view(bsz, -1).t().contiguous()
    cols = bsz // runtime.world_size  # this rank's streams: the global batch stays bsz columns
    return data[:, runtime.rank * cols:(runtime.rank + 1) * cols].contiguous().to(device)


eval_batch_size = 10
train_data = batchify(corpus.train, args.batch_size)
val_data = batchify(corpus.valid, eval_batch_size)
test_data = batchify(corpus.test, eval_batch_size)

###############################################################################
# Build the model
###############################################################################


class RNNModel(nn.Module):
    """Container module with an encoder, a recurrent module, and a decoder."""

    def __init__(self, ntoken, ninp, nhid, nlayers, dropout=0.5):
        super().__init__()
        self.ntoken = ntoken
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid
        self.nlayers = nlayers
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))


ntokens = len(corpus.dictionary)
model = dptrain.parallelize(RNNModel(ntokens, args.emsize, args.nhid, args.nlayers, args.dropout), device=device).module
criterion = nn.NLLLoss()

###############################################################################
# Training code
###############################################################################


def repackage_hidden(h):
    """Wraps hidden states in new Tensors, to detach them from their history."""
    if isinstance(h, torch.Tensor):
        return h.detach()
    return tuple(repackage_hidden(v) for v in h)


def get_batch(source, i):
    seq_len = min(args.bptt, len(source) - 1 - i)
    data = source[i:i + seq_len]
    target = source[i + 1:i + 1 + seq_len].view(-1)
    return data, target


def evaluate(data_source):
    model.eval()
    total_loss = 0.
    hidden = model.init_hidden(eval_batch_size // runtime.world_size)
    with torch.no_grad():
        for i in range(0, data_source.size(0) - 1, args.bptt):
            data, targets = get_batch(data_source, i)
            output, hidden = model(data, hidden)
            hidden = repackage_hidden(hidden)
            total_loss += len(data) * criterion(output, targets).item()
    return dptrain.all_reduce_mean(total_loss / (len(data_source) - 1))  # the same on every rank


losses = []


def train():
    model.train()
    total_loss = 0.
    start_time = time.time()
    hidden = model.init_hidden(args.batch_size // runtime.world_size)
    for batch, i in enumerate(range(0, train_data.size(0) - 1, args.bptt)):
        data, targets = get_batch(train_data, i)
        # Starting each batch, we detach the hidden state from how it was previously produced.
        hidden = repackage_hidden(hidden)
        model.zero_grad()
        output, hidden = model(data, hidden)
        loss = criterion(output, targets)
        loss.backward()
        # `clip_grad_norm` helps prevent the exploding gradient problem in RNNs / LSTMs.
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-lr)
        losses.append(dptrain.all_reduce_mean(loss.detach()).item())  # the global batch's loss
        total_loss += losses[-1]
        if batch % args.log_interval == 0 and batch > 0:
            cur_loss = total_loss / args.log_interval
            elapsed = time.time() - start_time
            dptrain.print0(f'| epoch {epoch:3d} | {batch:5d}/{len(train_data) // args.bptt:5d} batches | lr {lr:02.2f} '
                  f'| ms/batch {elapsed * 1000 / args.log_interval:5.2f} '
                  f'| loss {cur_loss:5.2f} | ppl {math.exp(cur_loss):8.2f}')
            total_loss = 0
            start_time = time.time()


# Loop over epochs.
lr = args.lr
best_val_loss = None
val_losses = []
for epoch in range(1, args.epochs + 1):
    epoch_start_time = time.time()
    train()
    val_loss = evaluate(val_data)
    val_losses.append(val_loss)
    dptrain.print0('-' * 89)
    dptrain.print0(f'| end of epoch {epoch:3d} | time: {time.time() - epoch_start_time:5.2f}s '
          f'| valid loss {val_loss:5.2f} | valid ppl {math.exp(val_loss):8.2f}')
    dptrain.print0('-' * 89)
    # Save the model if the validation loss is the best we've seen so far.
    if not best_val_loss or val_loss < best_val_loss:
        dptrain.save_model(model, args.save)  # your module's state dict, no DDP wrapper
        best_val_loss = val_loss
    else:
        # Anneal the learning rate if no improvement has been seen in the validation dataset.
        lr /= 4.0

# Load the best saved model.
dptrain.unwrap(model).load_state_dict(torch.load(args.save, weights_only=True))
# Run on test data.
test_loss = evaluate(test_data)
dptrain.print0('=' * 89)
dptrain.print0(f'| End of training | test loss {test_loss:5.2f} | test ppl {math.exp(test_loss):8.2f}')
dptrain.print0('=' * 89)
if args.losses and runtime.is_main:
    with open(args.losses, 'w') as f:
        json.dump({'loss': losses, 'val': val_losses, 'test': test_loss}, f)
