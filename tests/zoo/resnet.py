"""A ResNet written the usual way: a stem, ``layer1..3`` as nn.Sequentials of residual blocks
(BatchNorm, a 1x1 downsampling shortcut where the width changes), a forward with a pooling and
a flatten before ``fc``. Not an nn.Sequential and no hpar_layers(): a pipeline cuts it between
its residual blocks with torch's tracer."""

import torch, torch.nn as nn, torch.nn.functional as F

HPAR = {"steps": 10, "batch_size": 8, "lr": 0.05, "log_every": 2}


class Block(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = (
            None
            if stride == 1 and cin == cout
            else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self, classes=3):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layer1 = nn.Sequential(Block(8, 8), Block(8, 8))
        self.layer2 = nn.Sequential(Block(8, 16, 2), Block(16, 16))
        self.layer3 = nn.Sequential(Block(16, 16, 2))
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = self.layer3(self.layer2(self.layer1(self.stem(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def model():
    return ResNet()


def data(rank, world_size, batch_size):
    g = torch.Generator().manual_seed(900 + rank)
    for _ in range(1000):
        y = torch.randint(0, 3, (batch_size,), generator=g)
        x = torch.randn(batch_size, 1, 8, 8, generator=g) * 0.5 + y.view(-1, 1, 1, 1).float()
        yield x, y


def loss(output, targets):
    return F.cross_entropy(output, targets)
